"""Optional drafter capabilities beyond ``Drafter``: seams for draft models (EAGLE-3) and for
backends that draft a whole batch at once (SGLang). Definitions only; torch-free.

An engine checks for them with ``isinstance`` (both protocols are ``runtime_checkable``) and
falls back to the plain ``Drafter`` calls when a drafter lacks them:

- ``HiddenStateDrafter``: after each commit the engine hands the drafter the target model's
  hidden states at the layers it asked for (an EAGLE-3 head reads three: a low, a middle and a
  high layer), for the tokens just committed, before the next ``propose``.
- ``BatchDrafter``: one call drafts every running request of a step (a draft model runs one
  batched forward instead of one per request). ``propose_all`` is how an engine should call any
  drafter for a batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from .draft import Draft

__all__ = ["BatchDrafter", "HiddenStateDrafter", "OutputDrafter", "hidden_wanted", "propose_all", "tell_output",
           "wants_hidden_states"]


@runtime_checkable
class HiddenStateDrafter(Protocol):
    """A drafter that reads the target model's hidden states (a draft head such as EAGLE-3).

    ``hidden_layers``: the target layers whose outputs it wants, as layer indices (0 = the first
    decoder layer's output; negative counts from the last, -1 = the final layer before the norm),
    e.g. ``(2, 15, 28)`` for an EAGLE-3 head on a 32-layer model. The engine gathers only these.

    ``observe_hidden(req_id, tokens, hidden)`` is called after every forward that commits tokens
    to the target's KV cache, with those tokens and ``hidden[layer]``: a tensor-like of shape
    ``[len(tokens), hidden_size]`` holding that layer's output at each of their positions, for
    every layer in ``hidden_layers``. After prefill: the prompt. After each decode step: the
    step's root (the token committed last, whose row the step forwarded) and the accepted draft
    tokens, in order. The step's bonus token is not among them: its hidden state exists only
    once the next step forwards it (as that step's root). So over a request the calls cover
    every token of prompt + output except the last, each once, in order, and every call comes
    before the ``extend`` that reports the step's new tokens (accepted + bonus) and the next
    ``propose``. The arrays belong to the engine and may be reused after the call returns: copy
    what is kept. Positions the verifier rejected are never reported.
    """

    hidden_layers: tuple[int, ...]

    def observe_hidden(self, req_id: str, tokens: Sequence[int], hidden: Mapping[int, Any]) -> None: ...


@runtime_checkable
class BatchDrafter(Protocol):
    """A drafter that drafts several requests in one call.

    ``propose_batch(req_ids, budgets)`` returns one draft per request, in order, the i-th of at
    most ``budgets[i]`` tokens (a budget of 0 gets an empty draft), exactly as ``propose`` would
    for each. Requests must have been started; all their committed tokens have been reported.
    """

    def propose_batch(self, req_ids: Sequence[str], budgets: Sequence[int]) -> list[Draft]: ...


@runtime_checkable
class OutputDrafter(Protocol):
    """A drafter that reads the output's structure (a tool call's JSON arguments).

    ``output_format(req_id, output)`` is called once per request, after ``start`` and before the
    first ``propose``, for a request whose output has a known shape: ``output`` is its
    ``agentspec.backends.protocol.OutputFormat`` (the model's tool-call row, the tool names, a
    JSON answer). A request without one never gets the call: its output is free text.
    """

    def output_format(self, req_id: str, output: Any) -> None: ...


def tell_output(drafter: Any, req_id: str, output: Any) -> None:
    """Hand ``output`` (an ``OutputFormat``) to ``drafter`` where it reads one."""
    if output is not None and isinstance(drafter, OutputDrafter):
        drafter.output_format(req_id, output)


def hidden_wanted(drafter: Any, req_id: str) -> bool:
    """Whether ``drafter`` wants hidden states for this (started) request: a ``HiddenStateDrafter``
    may say no per request with an optional ``wants_hidden_for(req_id) -> bool`` (a gated draft
    head sitting the request out); the engine then gathers none for it."""
    f = getattr(drafter, "wants_hidden_for", None)
    return True if f is None else bool(f(req_id))


def wants_hidden_states(drafter: Any) -> tuple[int, ...]:
    """The target layers ``drafter`` wants hidden states of; ``()`` for a drafter that wants none."""
    if isinstance(drafter, HiddenStateDrafter):
        return tuple(int(x) for x in drafter.hidden_layers)
    return ()


def propose_all(drafter: Any, req_ids: Sequence[str], budgets: Sequence[int]) -> list[Draft]:
    """One draft per request: ``drafter.propose_batch`` when it has one, else ``propose`` per request.

    Raises ValueError when the lengths differ or a drafter's batch answer has the wrong length.
    """
    if len(req_ids) != len(budgets):
        raise ValueError(f"req_ids and budgets differ in length ({len(req_ids)}, {len(budgets)})")
    if not req_ids:
        return []
    if isinstance(drafter, BatchDrafter):
        drafts = list(drafter.propose_batch(req_ids, budgets))
        if len(drafts) != len(req_ids):
            raise ValueError(f"{type(drafter).__name__}.propose_batch returned {len(drafts)} drafts "
                             f"for {len(req_ids)} requests")
        return drafts
    return [drafter.propose(r, b) for r, b in zip(req_ids, budgets)]
