"""The scheduler actor and its planner (pure functions over frozen records)."""
