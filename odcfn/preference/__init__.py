"""Preference optimisation's pairs: ``preference_batch`` / ``with_ref_logprobs`` (pairs as data)
and how a pair moves through a step as one unit (``pairs.py``); the reference policy of a LoRA run
(``lora.py``, ``odcfn.lora_reference``). Re-exports only.

``lora_reference`` is not re-exported here: ``lora.py`` imports the LoRA wing, which imports the
models, which import the losses, which import ``pairs.py`` (so this package) back."""

from odcfn.preference.pairs import (
    check_pairs,
    expand_program,
    preference_batch,
    schedule_lengths,
    with_ref_logprobs,
)

__all__ = ["check_pairs", "expand_program", "preference_batch", "schedule_lengths", "with_ref_logprobs"]
