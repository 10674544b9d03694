"""Seeing what the agent does: the run report (`asyncwebrl view RUN_DIR`) with an episode browser,
training plots and the rollout/train/weight-sync timeline. Entry point: `asyncwebrl.view.report`."""
