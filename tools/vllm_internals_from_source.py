"""Check rlix_plugins/vllm/internals.py's list against vLLM *source* (no import): the releases we support on GPU
cannot be imported on a CPU machine, but their wheels can be read.

    pip download --no-deps --only-binary :all: --python-version 3.12 --platform manylinux_2_28_x86_64 vllm==0.25.1 -d W
    python tools/vllm_internals_from_source.py W/vllm-0.25.1-*.whl [more wheels or site-packages/vllm dirs]

Prints one row per entry and wheel: ``present`` / ``MISSING`` / ``unknown`` (the static reading could not decide, e.g. a
name made at run time). Static and conservative: a class is followed through ``from x import Name`` and its bases;
an instance attribute counts when some method of the class or a base assigns ``self.<name>``.
"""

from __future__ import annotations

import ast
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlix_plugins.vllm.internals import INTERNALS, Internal


class Source:
    """The ``vllm/**.py`` files of one wheel (or an unpacked ``vllm`` directory), parsed on demand."""

    def __init__(self, where: Path) -> None:
        self.files: dict[str, str] = {}
        if where.is_dir():
            for p in where.rglob("*.py"):
                self.files["vllm/" + p.relative_to(where).as_posix()] = p.read_text(encoding="utf-8", errors="replace")
        else:
            with zipfile.ZipFile(where) as z:
                for n in z.namelist():
                    if n.startswith("vllm/") and n.endswith(".py"):
                        self.files[n] = z.read(n).decode("utf-8", errors="replace")
        self.trees: dict[str, ast.Module | None] = {}

    def tree(self, module: str) -> ast.Module | None:
        if module not in self.trees:
            base = module.replace(".", "/")
            text = self.files.get(base + ".py", self.files.get(base + "/__init__.py"))
            self.trees[module] = ast.parse(text) if text is not None else None
        return self.trees[module]

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """The definition of ``name`` in ``module`` (following ``from x import name``)."""
        tree = self.tree(module)
        if tree is None or depth > 8:
            return None
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return module, node
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return module, node
        for node in ast.walk(tree):  # imports, also inside try/if blocks
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    if (a.asname or a.name) == name:
                        return self.resolve(node.module, a.name, depth + 1)
        return None

    def class_has(self, module: str, cls: ast.ClassDef, attr: str, how: str, depth: int = 0) -> bool:
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == attr and how != "field":
                return True
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == attr:
                return True
            if isinstance(node, ast.Assign) and how != "field" and any(
                    isinstance(t, ast.Name) and t.id == attr for t in node.targets):
                return True
        if how == "assigned":
            for node in ast.walk(cls):
                targets: list[ast.expr] = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AnnAssign):
                    targets = [node.target]
                if any(isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name)
                       and t.value.id == "self" for t in targets):
                    return True
        for base in cls.bases:
            if isinstance(base, ast.Name) and depth < 8:
                found = self.resolve(module, base.id)
                if found and isinstance(found[1], ast.ClassDef) and self.class_has(found[0], found[1], attr, how,
                                                                                    depth + 1):
                    return True
        return False

    def state(self, entry: Internal) -> str:
        if self.tree(entry.module) is None:
            return "MISSING (module)"
        parts = entry.attr.split(".") if entry.attr else []
        if not parts or entry.how == "use":
            return "present"
        if entry.name == "vllm.platforms.current_platform.is_cpu":  # a lazy module attribute: read its class
            iface = self.resolve("vllm.platforms.interface", "Platform")
            mentioned = "current_platform" in ast.unparse(self.tree("vllm.platforms") or ast.Module([], []))
            ok = mentioned and iface is not None and isinstance(iface[1], ast.ClassDef) and self.class_has(
                iface[0], iface[1], "is_cpu", "getattr")
            return "present" if ok else "MISSING"
        found = self.resolve(entry.module, parts[0])
        if found is None:
            return "MISSING"
        module, node = found
        rest = parts[1:]
        if entry.how == "param":
            rest, param = rest[:-1], rest[-1]
        for k, attr in enumerate(rest):
            if not isinstance(node, ast.ClassDef):
                return "unknown"
            if not self.class_has(module, node, attr, entry.how if k == len(rest) - 1 else "getattr"):
                return "MISSING"
            if k < len(rest) - 1 or entry.how == "param":
                inner = next((n for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                              and n.name == attr), None)
                if inner is None:
                    return "unknown"
                node = inner
        if entry.how == "param":
            if not isinstance(node, ast.FunctionDef):
                return "unknown"
            names = {a.arg for a in [*node.args.args, *node.args.kwonlyargs]}
            return "present" if param in names or node.args.kwarg else "MISSING"
        return "present"


def main(paths: list[str]) -> None:
    sources = [(Path(p).name, Source(Path(p))) for p in paths]
    for name, src in sources:
        print(f"== {name}: {len(src.files)} files")
    for entry in INTERNALS:
        states = [src.state(entry) for _, src in sources]
        print(f"{entry.name:75s} " + " | ".join(states))


if __name__ == "__main__":
    main(sys.argv[1:])
