"""AsyncWebRL: asynchronous multi-step RL for visual web agents."""

__version__ = "0.1.0"
