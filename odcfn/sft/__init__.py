"""``odcfn train``, the SFT application: its TOML config (``config``) and the training loop
with progress, metrics, checkpoints, resume and export (``loop``)."""
