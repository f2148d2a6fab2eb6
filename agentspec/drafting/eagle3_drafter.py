"""The EAGLE-3 drafter: a draft head over the target's hidden states, for text no index holds.

``Eagle3Drafter`` is a ``HiddenStateDrafter``: the engine hands it the target's feature-layer
outputs (low, mid, high; ``Eagle3Config.feature_layers``) for every committed token, through the
same forward that verified the step. Per request it keeps the head's own KV cache, filled from
the target's features (SGLang's "draft extend"), and drafts by running the head on its own
outputs (``docs/eagle3-format.md`` section 4 and 7):

- row ``t`` of the extend gets ``(token x[t+1], target features f[t], position t)``; its output
  predicts ``x[t+2]``;
- a draft step takes the previous row's output ``h2`` as its hidden input and the token it just
  drafted, at the next position; draft rows are dropped from the cache after the proposal (the
  next extend recomputes those positions from the target's features).

Proposals are a chain (the head's top-1 at every depth) with, optionally, the next ``topk - 1``
candidates at each depth as leaf siblings (they cost no head forward), with the head's
probabilities as ``Draft.probs`` for the verifier's cost cut. The chain stops early when its
survival estimate falls below ``min_survival``.

``Eagle3Gate`` keeps it honest per request: from the measured costs (seconds of a target step,
the engine's ``row_cost`` per verified row, the head's own seconds per proposal) it computes the
break-even accepted length below which the head loses time, tracks the head's accepted tokens
per proposal (a decayed mean) and turns the head off below break-even, probing now and then to
turn it back on. While off, the drafter only buffers the features of committed tokens (the
last ``context_window`` rows are run through the head when it turns on again).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .draft import EMPTY_DRAFT, Draft, accepted_in_tree
from .eagle3 import Eagle3Config, Eagle3Head, Eagle3KV

__all__ = ["SOURCE", "Eagle3Drafter", "Eagle3Gate", "GateCosts"]

SOURCE = "eagle3"


# --------------------------------------------------------------------------------------------
# the gate
# --------------------------------------------------------------------------------------------

@dataclass
class GateCosts:
    """What the gate weighs. ``step_seconds``: one target step of a single request; ``row_cost``:
    one more verified row relative to such a step (the engine's profiled ``row_cost``);
    ``head_seconds``: None = the head's own time per proposal, measured per request (extend
    included); a number = fixed (tests: an artificial cost profile). ``step_seconds`` may be a
    callable, read at each decision (the engine's running estimate)."""

    step_seconds: float | Any
    row_cost: float
    head_seconds: float | None = None

    def step(self) -> float:
        s = self.step_seconds() if callable(self.step_seconds) else self.step_seconds
        return max(float(s), 1e-6)


@dataclass
class Eagle3Gate:
    """Per-request on/off decision around the break-even accepted length.

    With the head, a step costs ``step + head + rows * row_cost * step`` seconds and yields
    ``tau + a`` tokens (``a``: the head's accepted tokens); without it ``step`` and ``tau``. The
    head pays iff ``a / (head + rows * row_cost * step) > tau / step``, i.e.

        a > breakeven = tau * (head / step + rows * row_cost)

    ``tau``: the request's tokens per step without the head's share, ``rows``: draft rows the
    head adds, ``head``: its seconds per proposal (decayed means). The head stays on while its
    decayed mean ``a`` is at least ``breakeven * margin``; off, it proposes again after ``probe``
    steps (doubling up to ``max_probe`` while probes fail; back to ``first_probe`` when one pays).
    """

    costs: GateCosts
    margin: float = 1.0
    decay: float = 0.8
    first_probe: int = 8
    max_probe: int = 128
    enabled: bool = True
    # per-request state
    a: float = 1.0                  # head's accepted tokens per proposal (optimistic prior)
    tau: float = 1.0                # tokens per step, the head's share excluded
    head: float = 0.0               # seconds of head work per proposal
    rows: float = 4.0               # draft rows the head adds per proposal
    on: bool = True
    off_steps: int = 0
    probe: int = 8
    samples: int = 0
    head_steps: int = 0             # steps the head proposed in
    _seen: bool = field(default=False, repr=False)
    _probing: bool = field(default=False, repr=False)

    def clone(self, prior: Eagle3Gate | None = None) -> Eagle3Gate:
        """A fresh per-request gate with this one's settings. ``prior``: what earlier requests
        measured (``learn``): the new request starts from their estimates and their decision,
        so a head that does not pay on this machine costs a new request nothing but probes
        (performance figures only: no request's text reaches another's drafts)."""
        g = Eagle3Gate(self.costs, margin=self.margin, decay=self.decay, first_probe=self.first_probe,
                       max_probe=self.max_probe, enabled=self.enabled, probe=self.first_probe)
        if prior is not None and prior.samples:
            g.a, g.tau, g.head, g.rows, g._seen = prior.a, prior.tau, prior.head, prior.rows, True
            g.samples = 3
            g.on = not self.enabled or g.a >= g.breakeven * g.margin
        return g

    def learn(self, finished: Eagle3Gate) -> None:
        """Fold a finished request's estimates into this (the drafter's prior for new requests)."""
        if not finished.head_steps:
            return
        w = 0.5 if self.samples else 1.0
        self.a = (1 - w) * self.a + w * finished.a
        self.tau = (1 - w) * self.tau + w * finished.tau
        self.head = (1 - w) * self.head + w * finished.head
        self.rows = (1 - w) * self.rows + w * finished.rows
        self.samples += 1

    @property
    def breakeven(self) -> float:
        c = self.costs
        head = c.head_seconds if c.head_seconds is not None else self.head
        return self.tau * (head / c.step() + self.rows * c.row_cost)

    def wants(self) -> bool:
        """Whether the head proposes this step (a step it sits out is counted)."""
        if not self.enabled or self.on:
            return True
        self.off_steps += 1
        if self.off_steps >= self.probe:
            self.off_steps, self._probing = 0, True
            return True
        return False

    def observe(self, accepted: int, rows: int, head_seconds: float, step_tokens: int) -> None:
        """A proposal's outcome: ``accepted`` of the head's ``rows`` draft tokens matched what the
        target committed, ``head_seconds`` spent, ``step_tokens`` committed by the step."""
        d = self.decay
        if not self._seen:
            self.head, self.rows, self._seen = head_seconds, float(rows), True
        else:
            self.head = d * self.head + (1 - d) * head_seconds
            self.rows = d * self.rows + (1 - d) * rows
        self.a = d * self.a + (1 - d) * accepted
        self.tau = d * self.tau + (1 - d) * max(step_tokens - accepted, 1)
        self.samples += 1
        self.head_steps += 1
        probed, self._probing = self._probing, False
        if not self.enabled:
            return
        pays = self.a >= self.breakeven * self.margin
        if self.on and not pays and self.samples >= 3:
            self.on, self.off_steps = False, 0
        elif not self.on and probed:
            if pays:
                self.on, self.probe = True, self.first_probe
            else:
                self.probe = min(self.probe * 2, self.max_probe)

    def observe_plain(self, step_tokens: int) -> None:
        """A step the head did not propose in: its tokens update ``tau``."""
        self.tau = self.decay * self.tau + (1 - self.decay) * max(step_tokens, 1)


# --------------------------------------------------------------------------------------------
# fast inference path
# --------------------------------------------------------------------------------------------

class _Runner:
    """The head's inference forward, with the engine's native row-invariant bf16 linears on CPU
    (``kernels.cpu_linear.PackedLinear``) where they run, torch's otherwise. Same maths as
    ``Eagle3Head.forward``."""

    def __init__(self, head: Eagle3Head) -> None:
        from ..kernels import cpu_linear

        self.head = head
        c = head.config
        self.H, self.hd = c.hidden_size, c.head_dim
        a = head.midlayer.self_attn
        self.n_heads, self.n_kv = a.n_heads, a.n_kv
        w = head.fc.weight
        self.dtype, self.device = w.dtype, w.device
        self.packed = cpu_linear.linear_supported(w.dtype, w.device)
        m = head.midlayer
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
        gate_up = torch.cat([m.mlp.gate_proj.weight, m.mlp.up_proj.weight]).detach()
        weights = {"fc": w.detach(), "qkv": qkv, "o": a.o_proj.weight.detach(), "gate_up": gate_up,
                   "down": m.mlp.down_proj.weight.detach(), "lm_head": head.lm_head.weight.detach()}
        if self.packed:
            self.lin = {k: cpu_linear.PackedLinear(v.contiguous()) for k, v in weights.items()}
        else:
            self.lin = {k: (lambda x, v=v: x @ v.t()) for k, v in weights.items()}
        self.kernels = "native bf16" if self.packed else f"torch {str(self.dtype).removeprefix('torch.')}"
        self.d2t = head.d2t
        self.scale = 1.0 / math.sqrt(self.hd)

    @torch.inference_mode()
    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv: Eagle3KV,
                 *, logits: str = "last") -> tuple[torch.Tensor | None, torch.Tensor]:
        """Rows ``[T]``: causal over ``kv`` + themselves; their keys/values are appended to ``kv``.
        Returns (draft-vocab logits of the last row (``logits="last"``) / every row (``"all"``),
        ``h2 [T, H]``)."""
        from ..kernels.rope import apply_rope

        head, L = self.head, self.lin
        dt = self.dtype
        embeds, hidden = embeds.to(dt), hidden.to(dt)
        g = L["fc"](hidden) if hidden.shape[-1] != self.H else hidden
        T = g.shape[0]
        m = head.midlayer
        u = torch.cat([m.input_layernorm(embeds), m.hidden_norm(g)], dim=-1)
        qkv = L["qkv"](u)
        nq, nk, hd = self.n_heads * self.hd, self.n_kv * self.hd, self.hd
        cos, sin = head._rope(positions)
        q = apply_rope(qkv[:, :nq].reshape(T, self.n_heads, hd).transpose(0, 1).float(), cos, sin)
        k = apply_rope(qkv[:, nq:nq + nk].reshape(T, self.n_kv, hd).transpose(0, 1).float(), cos, sin)
        v = qkv[:, nq + nk:].reshape(T, self.n_kv, hd).transpose(0, 1).float()
        past = len(kv)
        k, v = kv.append(k, v)
        G = self.n_heads // self.n_kv
        qg = q.view(self.n_kv, G * T, hd) if T == 1 else q.view(self.n_kv, G, T, hd).reshape(self.n_kv, G * T, hd)
        scores = torch.matmul(qg, k.transpose(1, 2)) * self.scale                    # [n_kv, G*T, S]
        if T > 1:
            S = past + T
            causal = torch.ones(T, S, dtype=torch.bool, device=g.device).tril(diagonal=past)
            scores = scores.view(self.n_kv, G, T, S).masked_fill(~causal, float("-inf")).view(self.n_kv, G * T, S)
        attn = torch.matmul(torch.softmax(scores, dim=-1), v)                        # [n_kv, G*T, hd]
        attn = attn.view(self.n_kv, G, T, hd).reshape(self.n_heads, T, hd).transpose(0, 1).reshape(T, nq)
        h1 = g + L["o"](attn.to(dt).contiguous())
        x = m.post_attention_layernorm(h1)
        gu = L["gate_up"](x)
        I = gu.shape[1] // 2
        h2 = h1 + L["down"]((torch.nn.functional.silu(gu[:, :I].float()) * gu[:, I:].float()).to(dt))
        rows = h2[-1:] if logits == "last" else h2
        out = L["lm_head"](head.norm(rows).to(dt).contiguous()).float() if logits != "none" else None
        return out, h2


# --------------------------------------------------------------------------------------------
# the drafter
# --------------------------------------------------------------------------------------------

@dataclass
class _Req:
    tokens: list[int]                                  # committed tokens (prompt + output)
    kv: Eagle3KV = field(default_factory=Eagle3KV)
    feats: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (first position, [n, 3H]) not yet run
    done: int = 0                                      # positions run through the head (rows 0..done-1)
    h_last: torch.Tensor | None = None                 # h2 of the last extend row
    logits_last: torch.Tensor | None = None            # its draft-vocab logits
    last_tree: tuple[list[int], list[int]] = ([], [])   # the head's last proposal (tokens, parents)
    proposed: bool = False
    declined: bool = False                             # the gate had the head sit out this step
    skipped: bool = False                              # ... and its features waited (restart small)
    observed: bool = False
    head_seconds: float = 0.0
    gate: Eagle3Gate | None = None
    dormant: bool = False                              # the head sits this request out entirely


class Eagle3Drafter:
    """EAGLE-3 drafting for the embedded engine (see the module docstring).

    ``head``: an ``Eagle3Head`` (its config's ``feature_layers`` are the target layers read);
    ``embed``: the target's input embedding ``[V, H]`` (shared, as SGLang does); ``depth``: the
    chain's maximum length; ``topk``: candidates kept per depth (the best continues the chain, the
    others are leaves); ``min_survival``: stop the chain below this estimate; ``min_prob``: leaves
    below this probability are dropped; ``context_window``: at most this many of the latest
    committed positions are run through the head when it starts (a long prompt's head prefill is
    bounded), ``resume_window`` when the gate turns it back on; ``gate``: an ``Eagle3Gate``
    template (None: always on); ``probe_requests``: while finished requests say the head does not
    pay, only one new request in this many tries it (the others skip it, features included).
    """

    name = SOURCE

    # defaults from the teacher-forced acceptance on development agent turns
    # (benchmarks/bench_eagle3_acceptance.py): top-4 leaves lift P(accepted >= 1) from 0.52 to
    # 0.62; a 256-token head context drafts as well as 1024 at a quarter of the head's prefill
    def __init__(self, head: Eagle3Head, embed: torch.Tensor, *, depth: int = 6, topk: int = 4,
                 min_survival: float = 0.02, min_prob: float = 0.02, context_window: int = 256,
                 resume_window: int = 32, probe_requests: int = 4, gate: Eagle3Gate | None = None) -> None:
        config: Eagle3Config = head.config
        if config.feature_layers is None or len(config.feature_layers) != 3:
            raise ValueError(f"EAGLE-3 head needs 3 feature layers, got {config.feature_layers}")
        if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(f"target embedding {tuple(embed.shape)} does not fit the head "
                             f"(vocab {config.vocab_size}, hidden {config.hidden_size})")
        if depth < 1 or topk < 1:
            raise ValueError(f"depth and topk must be >= 1, got {depth}, {topk}")
        self.head = head
        self.config = config
        self.embed = embed
        self.depth, self.topk = int(depth), int(topk)
        self.min_survival, self.min_prob = float(min_survival), float(min_prob)
        self.context_window = int(context_window)
        self.resume_window = int(resume_window)
        self.probe_requests = max(int(probe_requests), 1)
        self._started = 0
        self.gate = gate
        self.hidden_layers = tuple(config.feature_layers)
        self.runner = _Runner(head)
        self._reqs: dict[str, _Req] = {}
        # the gate's estimates over finished requests: where new requests start (Eagle3Gate.clone)
        self._prior = gate.clone() if gate is not None else None
        self._lock = threading.Lock()

    # ---- the Drafter protocol -----------------------------------------------------------------

    def start(self, req_id: str, prompt: Sequence[int], *, tenant: str = "default") -> None:
        with self._lock:
            gate = self.gate.clone(self._prior) if self.gate else None
            # while earlier requests found that the head does not pay, only one request in
            # probe_requests tries it (probes); the others skip it entirely, features included
            dormant = False
            if gate is not None and not gate.on:
                self._started += 1
                dormant = self._started % self.probe_requests != 0
            self._reqs[req_id] = _Req(tokens=list(prompt), gate=gate, dormant=dormant)

    def stop(self, req_id: str) -> None:
        with self._lock:
            r = self._reqs.pop(req_id, None)
            if r is not None and r.gate is not None:
                self._prior.learn(r.gate)

    def wants_hidden_for(self, req_id: str) -> bool:
        r = self._reqs.get(req_id)
        return r is not None and not r.dormant

    def observe_hidden(self, req_id: str, tokens: Sequence[int], hidden: Mapping[int, Any]) -> None:
        r = self._reqs.get(req_id)
        if r is None or r.dormant or not len(tokens):
            return
        lo, mid, hi = (hidden[i] for i in self.hidden_layers)
        f = torch.cat([lo, mid, hi], dim=-1).to(self.runner.dtype)   # a copy: the engine reuses its arrays
        # positions: the calls cover every committed token but the last, in order: the first
        # (prefill) the prompt, each later one the step's root (the last token extended) and
        # the accepted tokens (extended after this call)
        pos = len(r.tokens) - 1 if r.observed else len(r.tokens) - len(tokens)
        r.observed = True
        r.feats.append((pos, f))
        # bound what waits: the head's first catch-up reads at most context_window rows, a
        # restart after the gate had it off resume_window rows (older rows only cost memory)
        cap = self.resume_window if r.skipped else self.context_window
        total = sum(x.shape[0] for _, x in r.feats)
        while len(r.feats) > 1 and total - r.feats[0][1].shape[0] >= cap:
            total -= r.feats[0][1].shape[0]
            r.feats.pop(0)

    def extend(self, req_id: str, tokens: Sequence[int]) -> None:
        r = self._reqs.get(req_id)
        if r is None or r.dormant:
            return
        tokens = list(tokens)
        if r.proposed:
            # how deep the head's own tree matched what the target committed (leaves count)
            toks, parents = r.last_tree
            if r.gate is not None:
                r.gate.observe(accepted_in_tree(toks, parents, tokens), len(toks), r.head_seconds, len(tokens))
        elif r.declined and r.gate is not None and tokens:
            # only steps the gate declined tell what a step yields without the head; steps where
            # nobody asked (a confident suffix draft) are not the steps the head would be in
            r.gate.observe_plain(len(tokens))
        r.proposed = r.declined = False
        r.tokens += tokens

    def propose(self, req_id: str, budget: int) -> Draft:
        r = self._reqs.get(req_id)
        if r is None or r.dormant or budget <= 0:
            return EMPTY_DRAFT
        if r.gate is not None and not r.gate.wants():
            r.declined = r.skipped = True
            return EMPTY_DRAFT
        t0 = time.perf_counter()
        rows = self._catch_up(r)
        if rows < 0 or r.logits_last is None:
            return EMPTY_DRAFT
        t1 = time.perf_counter()
        draft = self._draft(r, budget)
        # the gate weighs a step's head work: a big catch-up (the prompt, a restart) is counted
        # as one step's worth of extend, not in full
        extend = (t1 - t0) if rows <= 16 else (t1 - t0) * 16 / rows
        r.head_seconds = extend + time.perf_counter() - t1
        r.proposed = bool(draft.token_ids)
        return draft

    # ---- internals ----------------------------------------------------------------------------

    def _catch_up(self, r: _Req) -> int:
        """Run the pending feature rows whose next token is known through the head (extend): the
        rows run, or -1 when the head has nothing to draft from yet."""
        ready = 0 if r.h_last is not None else -1
        if not r.feats:
            return ready
        n_known = len(r.tokens)
        # rows: position t has features f[t] and needs token x[t+1] (known iff t + 1 < n_known)
        start = r.feats[0][0]
        feats = torch.cat([f for _, f in r.feats]) if len(r.feats) > 1 else r.feats[0][1]
        end = min(start + feats.shape[0], n_known - 1)
        if end <= start:
            return ready
        feats = feats[:end - start]
        window = self.resume_window if r.skipped else self.context_window
        r.skipped = False
        if end - start > window:                                   # bound the head's prefill
            feats = feats[-window:]
            start = end - window
        if start != r.done:   # a gap (the gate was off, or the window cut the prompt): restart the cache
            r.kv = Eagle3KV()
        dev = self.runner.device
        nxt = torch.tensor(r.tokens[start + 1:end + 1], device=dev)
        pos = torch.arange(start, end, device=dev)
        logits, h2 = self.runner(self.embed[nxt], feats, pos, r.kv)
        r.h_last, r.logits_last = h2[-1:], logits[0]
        r.done = end
        # keep the rows not yet run (features past the last known token)
        rest = []
        for p, f in r.feats:
            if p + f.shape[0] > end:
                cut = max(end - p, 0)
                rest.append((p + cut, f[cut:]))
        r.feats = rest
        return end - start

    def _draft(self, r: _Req, budget: int) -> Draft:
        """Chain of the head's top-1 with top-k leaves; the draft rows are dropped from the cache."""
        base = len(r.kv)
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        logits, h = r.logits_last, r.h_last
        pos = r.done            # the first draft row's position: after the last extend row
        survival, parent = 1.0, -1
        d2t = self.runner.d2t
        dev = self.runner.device
        try:
            for depth in range(self.depth):
                if len(tokens) >= budget:
                    break
                p = torch.softmax(logits.float(), dim=-1)
                k = min(self.topk, p.shape[0])
                top_p, top_i = torch.topk(p, k)
                top_t = (top_i + d2t[top_i]).tolist()
                top_p = top_p.tolist()
                best_t, best_p = top_t[0], top_p[0]
                if survival * best_p < self.min_survival:
                    break
                tokens.append(best_t)
                parents.append(parent)
                probs.append(best_p)
                me = len(tokens) - 1
                for t, pr in zip(top_t[1:], top_p[1:]):        # leaves: the runner-up candidates
                    if len(tokens) >= budget or pr < self.min_prob or survival * pr < self.min_survival:
                        break
                    tokens.append(t)
                    parents.append(parent)
                    probs.append(pr)
                survival *= best_p
                parent = me
                if depth + 1 == self.depth or len(tokens) >= budget:
                    break
                logits, h = self.runner(self.embed[torch.tensor([best_t], device=dev)], h,
                                        torch.tensor([pos], device=dev), r.kv)
                logits = logits[0]
                pos += 1
        finally:
            r.kv.truncate(base)
        if not tokens:
            r.last_tree = ([], [])
            return EMPTY_DRAFT
        # best first by survival (a child never outranks its parent: probs <= 1, stable sort), as
        # the cost cut and the batch's slot selection, which keep prefixes, expect
        surv = Draft(tokens, parents, probs, 0.0, SOURCE).survival()
        order = sorted(range(len(tokens)), key=lambda i: -surv[i])
        where = {old: new for new, old in enumerate(order)}
        tokens = [tokens[i] for i in order]
        parents = [where[parents[i]] if parents[i] >= 0 else -1 for i in order]
        probs = [probs[i] for i in order]
        r.last_tree = (tokens, parents)
        return Draft(tokens, parents, probs, float(sum(surv)), SOURCE)   # score: the expected accepted length


# --------------------------------------------------------------------------------------------
# building one for an engine
# --------------------------------------------------------------------------------------------

# The head shipped for the bundled model (trained with ``agentspec train-eagle3``; see README).
BUNDLED_HEAD = "smollm2-135m-instruct-eagle3"


def bundled_head_path():
    """Where the head for the bundled SmolLM2-135M-Instruct ships (inside the package)."""
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "heads" / BUNDLED_HEAD


def head_path_for(engine, path=None):
    """The EAGLE-3 head directory for ``engine``: ``path``, else ``engine.eagle3`` (the engine's
    ``eagle3=`` option / ``--eagle3``), else ``$AGENTSPEC_EAGLE3``, else the shipped head when the
    engine runs the bundled model. Raises ``ModelLoadError`` saying what to do when none fits."""
    import os
    from pathlib import Path

    from ..errors import ModelLoadError

    for p in (path, getattr(engine, "eagle3", None), os.environ.get("AGENTSPEC_EAGLE3")):
        if p:
            return Path(p).expanduser()
    if getattr(engine, "runs_bundled_model", False):
        return bundled_head_path()
    raise ModelLoadError(f"no EAGLE-3 head for model {engine.model_path!r}: pass eagle3=DIR (--eagle3 DIR) "
                         f"or train one with `agentspec train-eagle3 --target MODEL --data FILES --out DIR`")


def for_engine(engine, *, path=None, gate: bool | None = None, **options) -> Eagle3Drafter:
    """An ``Eagle3Drafter`` on ``engine``'s model: the head loaded (once per engine and path) and
    checked against the target (a mismatch raises ``ModelLoadError`` naming it), the target's
    embedding shared, the gate fed by the engine's measured step time and ``row_cost`` (``gate``:
    None = the engine's ``eagle3_gate``)."""
    from .eagle3 import load_eagle3

    if engine is None:
        raise ValueError("the eagle3 drafter needs the engine (it reads the target's hidden states)")
    where = head_path_for(engine, path)
    cache = engine.draft_heads   # the engine's own: a head is loaded once per engine and path
    key = str(where.resolve()) if where.exists() else str(where)
    if key not in cache:
        from ..errors import ModelLoadError

        if not where.exists():
            raise ModelLoadError(f"EAGLE-3 head {str(where)!r} does not exist (train one with `agentspec "
                                 f"train-eagle3`, or see README 'EAGLE-3')")
        dtype = engine.dtype if engine.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        head, _ = load_eagle3(where, target_args=engine.args, dtype=dtype, device=engine.device)
        cache[key] = head
    head = cache[key]
    g = None
    if gate if gate is not None else getattr(engine, "eagle3_gate", True):
        dec = engine.decoder
        g = Eagle3Gate(GateCosts(step_seconds=lambda: dec.step_seconds or 0.01, row_cost=float(engine.row_cost)))
    return Eagle3Drafter(head, engine.model.embed.weight, gate=g, **options)
