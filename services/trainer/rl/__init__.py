"""RL post-training on the trainer side: trajectory groups from the rollout stream, GRPO/PPO losses, the RL step."""
