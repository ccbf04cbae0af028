"""Checkpoints: sharded, checksummed safetensors files committed atomically (``sharded``),
the commit protocol (``commit``), verification on load (``verify``), and save/load of a whole
``TrainState`` (``state_io``)."""
