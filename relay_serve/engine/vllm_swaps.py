"""The in-engine look-ahead of stop strings (``stops.py``'s swaps): a vLLM logits processor.

A resumable request cannot stop on a string, only on token ids, so a cue like ``"Thus,"`` used to
pause after ``" Thus"`` and generate one token more to see whether a comma followed: a round trip
in which the request sits out a step of the batch. Instead, a segment's chunk names, for each
*trigger* token (one that can end a stop's prefix), the tokens that would complete a stop right
after it, each with a *stand-in*: a token id the model never writes, which the chunk stops on.
When a request's last token is a trigger, this processor moves each completing token's logit to
its stand-in (and masks the completing token): the sampler draws the stand-in exactly as often as
it would have drawn the token it stands for, whatever the temperature, top-p or top-k (they act on
values, not ids), and the request stops right there. The session maps the stand-in back
(``VLLMResumable``); the engine's KV cache never holds it (vLLM drops the last sampled token of a
chunk). At every other step the stand-ins are masked, so that one is never written for itself.

Loaded by vLLM's engine core by name (``logits_processors``); requests without ``SWAPS`` in their
``extra_args`` are left alone. Argmax is not invariant under it, so greedy requests get it too.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates

SWAPS = "relay_swaps"  # extra_args key: PauseIds.wire, [[trigger, [completing...], [stand-in...]], ...]
CONTINUED = "relay_continued"  # extra_args key: the chunk's last fed token is the segment's own (after a pause)
QUALNAME = f"{__name__}:StandInSwaps"


class _Swaps:
    __slots__ = ("triggers", "standins", "prompt", "output")

    def __init__(self, spec: list[list[Any]], prompt: list[int] | None, output: list[int], device) -> None:
        """``prompt``: the request's context, whose last token is looked at on the chunk's first
        step (None: not, when it is context and not the segment's text, where no stop can begin)."""
        self.triggers = {
            int(t): (
                torch.tensor(cs, dtype=torch.long, device=device),
                torch.tensor(ss, dtype=torch.long, device=device),
            )
            for t, cs, ss in spec
        }
        self.standins = torch.tensor(sorted({s for _, _, ss in spec for s in ss}), dtype=torch.long, device=device)
        self.prompt = prompt
        self.output = output  # vLLM's live list of the request's output tokens

    def last(self) -> int:
        """The token the next one follows (-1: none that can begin a stop)."""
        if self.output:
            return self.output[-1]
        return self.prompt[-1] if self.prompt else -1  # a chunk's first step: the last token fed


class StandInSwaps(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        self.rows: dict[int, _Swaps] = {}
        self._masked: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, ids) of every row's stand-ins

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        spec = (sampling_params.extra_args or {}).get(SWAPS)
        if spec is None:
            return
        if not isinstance(spec, list) or not all(
            isinstance(r, list) and len(r) == 3 and isinstance(r[0], int) and len(r[1]) == len(r[2]) for r in spec
        ):
            raise ValueError(f"extra_args[{SWAPS!r}] must be [[trigger, [completing...], [stand-in...]], ...]")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new(params: SamplingParams, prompt: list[int] | None, output: list[int]) -> _Swaps | None:
            extra = (params.extra_args or {}) if params is not None else {}
            spec = extra.get(SWAPS)
            return _Swaps(spec, prompt if extra.get(CONTINUED) else None, output, self.device) if spec else None

        if process_dict_updates(self.rows, batch_update, new):  # one index op masks every row's stand-ins
            rows = [torch.full_like(swaps.standins, row) for row, swaps in self.rows.items()]
            ids = [swaps.standins for swaps in self.rows.values()]
            self._masked = (torch.cat(rows), torch.cat(ids)) if rows else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._masked is None:
            return logits
        logits[self._masked] = float("-inf")
        for row, swaps in self.rows.items():  # a dict lookup a row; tensor work only after a trigger
            pair = swaps.triggers.get(swaps.last())
            if pair is not None:
                completing, standins = pair
                logits[row, standins] = logits[row, completing]
                logits[row, completing] = float("-inf")
        return logits
