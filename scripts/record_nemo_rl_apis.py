"""Write a patch series' record of NeMo RL signatures (``apis.json``, read by ``rlix patch drift``) from an
unpatched NeMo RL checkout at the series' pin. Run when a series is written or its pin moves:

    python scripts/record_nemo_rl_apis.py /path/to/RL rlix_plugins/patches/nemo-rl/7ea279a
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlix_plugins._patch_series import load_series
from rlix_plugins.patch_drift import APIS_FILE, record_apis

if __name__ == "__main__":
    checkout, directory = Path(sys.argv[1]), Path(sys.argv[2])
    record = record_apis(checkout, load_series(directory))
    (directory / APIS_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{directory / APIS_FILE}: {sum(len(v) for v in record['apis'].values())} signatures")  # type: ignore[attr-defined]
