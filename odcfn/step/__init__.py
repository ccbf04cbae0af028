"""The step: state and config, the executor of a rank's program, the minibatch fingerprint,
train/grad steps and forward-only passes."""
