"""``rlix simulate`` (the capacity simulator and its baselines) and the timeline picture of a trace."""
