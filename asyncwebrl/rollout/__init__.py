"""The rollout side (SPEC sections 2, 4, 9): how trajectories are produced for the trainer.

- `staleness.StalenessManager`: the admission rule (concurrency and staleness budget).
- `gate.ResumeGate` / `gate.GatedClient`: pause/resume of new episodes and generation requests.
- `executor.WorkflowExecutor`: everlasting rollout slots on an event-loop thread.
- `workflow.EpisodeGroupWorkflow` / `workflow.EpisodeRolloutSpec`: one rollout = one GRPO group of
  n_samples episodes of the same task through the shared episode loop (`episode.run_episode`).
- `hosts`: executors in this process or in Ray actors; `controller.RolloutController`: the pending
  queue, `prepare_batch`, weight-update brackets, statistics; `sync_pool.SyncRolloutPool`: the
  synchronous WebGym-style baseline behind the same interface.
- `trajectory`: the records that cross processes (StepSample, Trajectory, RolloutGroup).
"""
