"""One decode step, the only one: every embedded-engine path runs its requests through ``Decoder``.

A step (DESIGN.md section 4), for one request or a batch:

1. drafts in: each request's drafter is told the tokens committed last step and proposes a tree
   within the request's ``DraftPolicy`` budget; the policy shapes it (``min_prob``, cost cut with
   the request's trust, chain-only in deterministic mode);
2. tree rows and mask: ``[last committed token] + draft`` per request, padded where the kernels
   need it (a row's logits must not depend on what else shares the forward);
3. one forward (``Transformer.forward`` for one request, ``forward_segments`` for several);
4. verification: greedy (the target's argmax) or seeded sampling (the target's token at each
   position drawn by Gumbel-max from noise keyed by (seed, position), see ``verify.seeded_target``);
   a draft token is accepted iff it is the target's token, so output never depends on the drafts;
   a request with a grammar (``constraint.Constraint``) takes each row's target under the mask
   plain decoding would apply there (the grammar state after the path to that row);
5. commit: the accepted path stays in the KV cache; counts go to the request's stats.

``EmbeddedEngine`` (one request at a time), ``BatchEngine`` (continuous batching) and the
acceptance replay (``benchmarks/replay.py``, through ``DraftPolicy``) share it.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..config import SpecConfig
from ..drafting import EMPTY_DRAFT, Draft, Drafter
from ..drafting.draft import AcceptanceTracker
from ..drafting.protocols import hidden_wanted, propose_all, tell_output, wants_hidden_states
from ..kernels.cpu_linear import argmax_rows
from ..kernels.tree import greedy_verify_batch, tree_depths, tree_mask, with_root
from ..text import stop_index
from .policy import MAX_STEP_ROWS, DraftPolicy
from .results import Generation, GenerationStats
from .verify import greedy_verify, seeded_target

if TYPE_CHECKING:   # the embedded engine's model runs the step's forwards; the step does not import it
    from ..backends.embedded.model import KVCache
    from ..backends.protocol import GenerationRequest, OutputFormat
    from .constraint import Constraint

# canonical prefix-cache chunks per prefill forward where prefill rows are split-invariant (8:
# 2048 rows, a 1.5k-token prompt in one forward; ~5% faster prefill than 4 on the AMX path: fewer
# passes over the weights and fewer forwards' set-up)
PREFILL_CHUNKS = 8

__all__ = ["MAX_STEP_ROWS", "Decoder", "SeqState", "run_single", "spec_decision", "with_forced"]




_ids = itertools.count()


def with_forced(forced: list[int], draft: Draft, budget: int) -> Draft:
    """``forced`` (tokens the grammar admits alone next) as a chain of certain nodes, then the
    nodes of ``draft`` whose path starts with them (re-rooted at the last forced token); at most
    ``budget`` nodes. Node sources: "grammar" for the forced ones, the drafter's for the rest."""
    forced = forced[:budget]
    k = len(forced)
    tokens, parents = list(forced), list(range(-1, k - 1))
    probs, sources = [1.0] * k, ["grammar"] * k
    if draft.token_ids and len(tokens) < budget:
        paths: list[list[int]] = []
        new_index: dict[int, int] = {}
        for i, (t, p) in enumerate(zip(draft.token_ids, draft.parents)):
            path = (paths[p] if p >= 0 else []) + [t]
            paths.append(path)
            if len(path) > k and path[:k] == forced and len(tokens) < budget:
                par = k - 1 if len(path) == k + 1 else new_index.get(p)
                if par is None:
                    continue
                new_index[i] = len(tokens)
                tokens.append(t)
                parents.append(par)
                probs.append(draft.probs[i])
                sources.append(draft.source_of(i))
    out = Draft(tokens, parents, probs, 0.0, "grammar" if len(tokens) == k else f"grammar+{draft.source}", sources)
    return Draft(tokens, parents, probs, float(sum(out.survival())), out.source, sources)


def spec_decision(spec: SpecConfig | None, greedy: bool) -> tuple[bool, str]:
    """Whether a request speculates, and why (``GenerationStats.spec_reason``)."""
    if spec is None:
        return False, "disabled by request (spec=None)"
    if spec.budget == 0:
        return False, "budget 0"
    return True, "greedy" if greedy else "sampled: exact tree speculative sampling (Gumbel-max, seeded)"


@dataclass(eq=False)
class SeqState:
    """One request's decoding state."""

    ids: list[int]                       # the prompt
    max_tokens: int
    greedy: bool                         # the target's argmax (temperature 0); else seeded sampling
    temperature: float
    top_p: float
    top_k: int
    seed: int                            # sampling noise key (drawn at random when the request gave none)
    stops: list[str]
    spec_on: bool
    policy: DraftPolicy
    drafter: Drafter | None
    tenant: str
    stats: GenerationStats
    req_id: str = field(default_factory=lambda: f"seq-{next(_ids)}")
    cache: KVCache | None = None
    out: list[int] = field(default_factory=list)
    new: list[int] = field(default_factory=list)   # committed last step, not yet told to the drafter
    tracker: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    finish: str = "length"
    t_start: float = 0.0
    width: int = 0                       # deterministic mode: fixed rows per forward
    key_len: int = 0                     # deterministic mode: fixed key length
    hidden_layers: tuple[int, ...] = ()  # target layers the drafter wants (HiddenStateDrafter)
    started: bool = False                # the drafter has started this request (stop it at the end)
    constraint: Constraint | None = None  # the request's grammar, in the state after its committed tokens
    output: OutputFormat | None = None     # how the output reads (told to drafters that read it)

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.out)


class Decoder:
    """Runs prefill and decode steps on an ``EmbeddedEngine``'s model."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.model = engine.model
        self.device = engine.device
        # seconds per request of a decode step (decayed mean over steps): a draft head's gate
        # weighs its own cost against it (``drafting.eagle3_drafter.Eagle3Gate``)
        self.step_seconds: float | None = None
        # batched forwards without the native attention pad every request to 2 rows (below)
        self.native_attention = engine.model.plan().layered_attention == "native"

    # ---- a request's life ---------------------------------------------------------------------

    def sequence(self, request: GenerationRequest, *, drafter: Drafter | None, off_reason: str | None = None,
                 note: str = "", constraint: Constraint | None = None) -> SeqState:
        """A request's state, from the request its backend checked (``check_request``): nothing is
        checked again here. ``drafter``: what it drafts with (None: nothing); ``off_reason``: turn
        speculation off for this reason (a caller's policy); ``note``: appended to the reason it
        is on; ``constraint``: the request's grammar compiled (``EmbeddedEngine.constraint_for``)
        where the caller compiled it already, else it is compiled here (InvalidRequestError,
        param "grammar", for a grammar llguidance refuses)."""
        e = self.engine
        if constraint is None and request.grammar is not None:
            constraint = e.constraint_for(request.grammar)
        spec, greedy = request.spec, request.greedy
        on, reason = spec_decision(spec, greedy)
        if on and off_reason:
            on, reason = False, off_reason
        width = e.deterministic_width if e.deterministic else 0
        policy = DraftPolicy.for_request(spec if on else None, row_cost=e.row_cost,
                                         max_rows=width or MAX_STEP_ROWS, chain_only=bool(width))
        if on:
            reason += note + (", deterministic" if width else "") + (f", {policy.note}" if policy.note else "")
        layers = wants_hidden_states(drafter) if on else ()
        n = e.args.n_layers
        if any(not -n <= i < n for i in layers):
            raise ValueError(f"{type(drafter).__name__}.hidden_layers {layers} must be layer indices in [-{n}, {n})")
        # sampled requests: the noise key (the request's seed, or a random one, recorded in the stats)
        key = None if greedy else secrets.randbits(63) if request.seed is None else int(request.seed)
        ids = request.prompt_ids
        return SeqState(ids=ids, max_tokens=request.max_tokens, greedy=greedy, temperature=request.temperature,
                        top_p=request.top_p, top_k=request.top_k, seed=key or 0, stops=list(request.stop),
                        spec_on=on, policy=policy, drafter=drafter if on else None, tenant=request.tenant,
                        width=width, hidden_layers=layers, constraint=constraint, output=request.output,
                        stats=GenerationStats(prompt_tokens=len(ids), spec_enabled=on, spec_reason=reason,
                                              seed=key))

    def cache_need(self, seq: SeqState) -> int:
        """KV slots the request can use: prompt, output and one step's rows."""
        return len(seq.ids) + seq.max_tokens + max(seq.policy.budget, seq.width) + 2

    def prefill(self, seq: SeqState) -> list[int]:
        """Start the drafter, run the prompt into ``seq.cache``; the first token, as a list."""
        steps = self.prefill_steps(seq)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def prefill_steps(self, seq: SeqState) -> Generator[None, None, list[int]]:
        """``prefill`` one forward at a time: the generator yields after each prompt chunk but the
        last (another request may run a step there: each chunk is computed as ``prefill`` computes
        it, on the full thread team, at the same absolute positions, so the bits are the same
        however the chunks interleave with other work) and returns the first token, as a list.
        Closing it early leaves the drafter started and the cache partly written (the caller
        releases the request)."""
        seq.t_start = time.perf_counter()
        if seq.spec_on:
            td = time.perf_counter()
            seq.drafter.start(seq.req_id, seq.ids, tenant=seq.tenant)
            seq.started = True
            tell_output(seq.drafter, seq.req_id, seq.output)
            if seq.hidden_layers and not hidden_wanted(seq.drafter, seq.req_id):
                seq.hidden_layers = ()   # a draft head sits this request out: gather nothing
            seq.stats.draft_seconds += time.perf_counter() - td
        self.engine.governor.update()
        ids, dev = seq.ids, self.device
        layers = self._layers([seq])
        pc = self.engine.prefix_cache
        C = self.engine.chunk_tokens
        start = 0
        # a prefill whose rows do not depend on where the prompt is cut reuses any prefix (the
        # partial last chunk of an earlier prompt included), else whole chunks
        to_token = pc is not None and self.model.prefill_split_invariant(seq.cache)
        if pc is not None and not layers:  # (a draft head reads every prompt row's hidden states)
            # a hit stops short of the last token: its row gives the first token
            if to_token:
                hit = pc.lookup(seq.tenant, ids, max_tokens=len(ids) - 1)
            else:
                hit = pc.lookup(seq.tenant, ids, max_chunks=(len(ids) - 1) // C)
            try:
                for j, (k, v) in enumerate(hit.payloads):
                    if hit.tail and j == len(hit.payloads) - 1:
                        k, v = k[:, :, :hit.tail], v[:, :, :hit.tail]
                    seq.cache.load(j * C, k, v)
            finally:
                pc.release(hit)
            start = hit.tokens
            seq.cache.commit(list(range(start)))
            pc.stats.observe_lookup(start, len(ids) - start)
        seq.stats.cached_tokens = start
        tokens = torch.tensor(ids, device=dev)
        hiddens: list[dict] = []
        # the canonical prefill: chunks at absolute multiples of C (prefix_cache.py, "Exactness")
        # at a fixed thread count (ThreadGovernor.full_team: GEMM bits may depend on it). On the
        # AMX path every row's bits are independent of the split (Transformer.prefill_row_invariant):
        # there a forward takes PREFILL_CHUNKS chunks at once, the same bits with fewer passes
        # over the weights.
        step = C * PREFILL_CHUNKS if self.model.prefill_row_invariant(seq.cache) else C
        a = start
        while a < len(ids):
            b = min((a // step + 1) * step, len(ids))   # (a hit inside a chunk: to its end first)
            with self.engine.governor.full_team():
                out = self.model(tokens[a:b], torch.arange(a, b, device=dev), seq.cache,
                                 logits_rows=slice(-1, None), hidden_layers=layers, prefill=True)
            logits, hidden = out if layers else (out, None)
            seq.cache.commit(list(range(b - a)))
            if hidden is not None:
                hiddens.append(hidden)
            a = b
            if a < len(ids):
                yield
        if hiddens:
            self._observe(seq, ids, {i: torch.cat([h[i] for h in hiddens]) for i in hiddens[0]}, None)
        if pc is not None and (len(ids) // C > start // C or to_token and len(ids) > start):
            store = self.engine.prefix_cache_dtype
            pc.insert(seq.tenant, ids, len(ids) // C,
                      lambda j: _chunk(seq.cache, j * C, min((j + 1) * C, len(ids)), store), tail=to_token)
        first = self._target(seq, logits[0], len(ids))
        if seq.constraint is not None:
            seq.constraint.consume([first])
        seq.stats.prefill_seconds = time.perf_counter() - seq.t_start
        return [first]

    def accept(self, seq: SeqState, new: list[int]) -> tuple[list[int], bool]:
        """Append ``new`` to the output up to EOS / max_tokens / a stop string: (added, done);
        ``seq.finish`` says why it is done."""
        added: list[int] = []
        eos = self.engine.tokenizer.eos_token_ids
        out = seq.out
        done = False
        for t in new:
            if t in eos:
                seq.finish, done = "stop", True
                break
            out.append(t)
            added.append(t)
            if seq.stops and self._hit_stop(out, seq.stops):
                seq.finish, done = "stop", True
                break
            if len(out) >= seq.max_tokens:
                seq.finish, done = "length", True
                break
        if not done and seq.constraint is not None and seq.constraint.stopped:
            seq.finish, done = "stop", True   # the grammar is complete: only EOS may follow
        seq.new = added
        return added, done

    def propose(self, seq: SeqState, *, cost_cut: bool = True) -> Draft:
        """Tell the drafter last step's tokens; its draft, shaped by the request's policy."""
        return self.propose_many([seq], cost_cut=cost_cut)[0]

    def propose_many(self, seqs: list[SeqState], *, cost_cut: bool = True) -> list[Draft]:
        """``propose`` for a batch: requests sharing a drafter that drafts batches at once
        (``BatchDrafter``) get one ``propose_batch`` call (``propose_all``)."""
        drafts: list[Draft] = [EMPTY_DRAFT] * len(seqs)
        groups: dict[int, list[int]] = {}
        td = time.perf_counter()
        for i, s in enumerate(seqs):
            if s.spec_on:
                s.drafter.extend(s.req_id, s.new)
                groups.setdefault(id(s.drafter), []).append(i)
        for idx in groups.values():
            live = [(i, b) for i in idx if (b := seqs[i].policy.budget_for(seqs[i].remaining)) > 0]
            if not live:
                continue
            budgets = [b for _, b in live]
            for (i, b), d in zip(live, propose_all(seqs[live[0][0]].drafter, [seqs[i].req_id for i, _ in live],
                                                   budgets)):
                d.validate(b)
                drafts[i] = d
        share = (time.perf_counter() - td) / max(sum(len(v) for v in groups.values()), 1)
        for i, (s, d) in enumerate(zip(seqs, drafts)):
            if s.spec_on:
                s.stats.draft_seconds += share
            if s.constraint is not None and s.spec_on:
                # the grammar-legal part only: an illegal token never equals a masked target
                d = s.constraint.legal(d) if d.token_ids else d
                # what the grammar forces next is a free draft, verified like any other
                budget = s.policy.budget_for(s.remaining)
                forced = s.constraint.forced(budget) if budget > 0 and s.policy.forced_drafts else []
                drafts[i] = with_forced(forced, d, budget) if forced else d
        return [s.policy.shape(d, trust=s.tracker.trust, cost_cut=cost_cut) for s, d in zip(seqs, drafts)]

    def release(self, seq: SeqState) -> None:
        """Stop the drafter for this request (idempotent) and drop its cache."""
        seq.cache = None
        seq.spec_on = False
        if seq.started:
            seq.started = False
            seq.drafter.stop(seq.req_id)

    def result(self, seq: SeqState) -> Generation:
        """The Generation of a finished request: totals in its stats, text cut at a stop string."""
        stats = seq.stats
        stats.completion_tokens = len(seq.out)
        if seq.constraint is not None:
            stats.grammar_seconds = seq.constraint.seconds
        stats.seconds = time.perf_counter() - seq.t_start
        stats.decode_seconds = stats.seconds - stats.prefill_seconds
        if stats.steps:
            stats.mean_acceptance_length = sum(stats.acceptance_lengths) / stats.steps
        text = self.engine.tokenizer.decode(seq.out)
        cut = stop_index(text, seq.stops)
        return Generation(text=text[:cut] if cut >= 0 else text, token_ids=list(seq.out), finish_reason=seq.finish,
                          stats=stats)

    # ---- the step -----------------------------------------------------------------------------

    def step(self, seqs: list[SeqState], drafts: list[Draft], *, batched_verify: bool = False) -> list[list[int]]:
        """One forward over every request's ``[last token] + draft``; verify; commit. The new
        committed tokens per request (accepted draft tokens, then the bonus token)."""
        self.engine.governor.update()
        t_step = time.perf_counter()
        model, dev = self.model, self.device
        single = len(seqs) == 1
        # Rows per request. One request: at least 2 rows unless the forward is row-invariant by
        # construction (native linears and attention): some CPU matmul kernels take another
        # path for a single row. Several: the native attention gives a row the same bits
        # whatever else is in the forward, so a request needs no padding row once the batch has
        # 2 rows; small_attention is not exact for a lone row next to other requests' rows, so
        # without the native kernel every request runs at least 2 rows.
        if single:
            pad_each = not model.row_invariant(seqs[0].cache)
        else:
            pad_each = not self.native_attention or (sum(1 + len(d.token_ids) for d in drafts) < 2
                                                     and not model.row_invariant(seqs[0].cache))
        toks: list[int] = []
        poss: list[int] = []
        segs: list = []   # [model.Segment]
        layout = []
        for s, d in zip(seqs, drafts):
            start = s.cache.length
            tokens = [s.out[-1], *d.token_ids]   # T: the root (last committed token), then the draft tree
            parents = with_root(d.parents)       # T: each node's parent row (-1: the root)
            depths = tree_depths(parents)        # T: distance from the root (its position offset)
            T = len(tokens)
            if T > MAX_STEP_ROWS or (s.width and T > s.width):
                raise ValueError(f"a draft of {T - 1} tokens exceeds the step's rows ({MAX_STEP_ROWS})")
            rows = s.width if s.width else (max(T, 2) if pad_each else T)
            key_len = s.key_len if s.width else start + rows
            mask = torch.zeros(rows, key_len, dtype=torch.bool, device=dev)   # [rows, key_len] bool
            mask[:, :start] = True
            mask[:T, start:start + T] = tree_mask(parents, device=dev)
            for i in range(T, rows):  # padding rows see only themselves (and the prefix unless fixed-shape)
                if s.width:
                    mask[i, :start] = False
                mask[i, start + i] = True
            toks += tokens + [tokens[0]] * (rows - T)
            poss += [start + x for x in depths] + [start] * (rows - T)
            segs.append(model.Segment(cache=s.cache, rows=rows, mask=mask))   # the model's own record
            layout.append((tokens, parents, depths, T))
        layers = self._layers(seqs)
        # [R] int64 each: R = sum of the requests' rows, request after request (segs[i].offset)
        tok_t, pos_t = torch.tensor(toks, device=dev), torch.tensor(poss, device=dev)
        # an all-greedy step reads only argmaxes: the logits in the head's own dtype (no float32
        # copy), read by ``argmax_rows`` (native for bfloat16 on CPU): the same indices
        sampled = not all(s.greedy for s in seqs)
        if single:
            s = seqs[0]
            out = model(tok_t, pos_t, s.cache, segs[0].mask, key_len=s.key_len if s.width else None,
                        logits_rows=slice(0, layout[0][3]) if s.width else None, hidden_layers=layers,
                        float_logits=sampled)
            segs[0].offset = 0
        else:
            out = model.forward_segments(tok_t, pos_t, segs, hidden_layers=layers, float_logits=sampled)
        # logits [R, vocab] (float32 where a request samples); hidden: {layer: [R, dim]} for the
        # layers a draft head reads
        logits, hidden = out if layers else (out, None)
        verified = self._verify_greedy_batch(seqs, segs, layout, logits) if batched_verify else {}
        news = []
        for s, d, sg, (tokens, parents, depths, T) in zip(seqs, drafts, segs, layout):
            lg = logits[sg.offset:sg.offset + T]   # [T, vocab]: this request's real rows
            start = s.cache.length
            if id(s) in verified:
                path, bonus = verified[id(s)]
            elif s.constraint is not None:
                path, bonus = self._verify_constrained(s, tokens, parents, depths, lg, start)
            elif not s.greedy:
                targets = _LazyTargets(lambda i, lg=lg, s=s, start=start, depths=depths:
                                       self._target(s, lg[i], start + depths[i] + 1))
                path, bonus = greedy_verify(tokens, parents, targets)
            else:
                path, bonus = greedy_verify(tokens, parents, argmax_rows(lg).tolist())   # argmax: [T]
            s.cache.commit(path)
            if s.hidden_layers and hidden is not None:
                self._observe(s, [tokens[i] for i in path], hidden,
                              torch.tensor([sg.offset + i for i in path], device=dev))
            new = [tokens[i] for i in path[1:]] + [bonus]
            self._count(s, d, depths, path)
            news.append(new)
        per = (time.perf_counter() - t_step) / len(seqs)
        self.step_seconds = per if self.step_seconds is None else 0.9 * self.step_seconds + 0.1 * per
        return news

    # ---- helpers ------------------------------------------------------------------------------

    def _layers(self, seqs: list[SeqState]) -> tuple[int, ...]:
        """The target layers any of ``seqs``' drafters wants hidden states of (as indices >= 0)."""
        n = self.engine.args.n_layers
        return tuple(sorted({i % n for s in seqs for i in s.hidden_layers}))

    def _observe(self, seq: SeqState, tokens: list[int], hidden: dict, rows: torch.Tensor | None) -> None:
        """Hand ``seq``'s drafter the hidden states of the tokens just committed (``rows`` of the
        forward; None: all), keyed by the layer indices it asked for."""
        n = self.engine.args.n_layers
        seq.drafter.observe_hidden(seq.req_id, tokens, {k: hidden[k % n] if rows is None else hidden[k % n][rows]
                                                        for k in seq.hidden_layers})

    def _target(self, seq: SeqState, logits: torch.Tensor, position: int, top: int | None = None) -> int:
        """The target's token at ``position`` from the logits of the row before it (``top``: their
        argmax where the caller has it). With a grammar, among the tokens it allows in its current
        state: greedy, the row's argmax when the grammar allows it (then it is the masked argmax
        too: masking only removes tokens, and the first index of the maximum stays the first),
        else the argmax of the masked logits; sampled, the seeded draw from the masked logits
        (the mask first, then temperature, top-k, top-p, as vLLM applies its bitmask)."""
        c = seq.constraint
        if c is not None and c.stopped:
            return c.end_token   # the grammar is complete: EOS alone is legal (the output ends here)
        if seq.greedy:
            t = int(logits.argmax()) if top is None else top
            if c is None or c.allows(t):
                return t
            return c.masked_argmax(logits)
        if c is not None:
            logits = c.masked(logits)
        return seeded_target(logits, seed=seq.seed, position=position, temperature=seq.temperature,
                             top_p=seq.top_p, top_k=seq.top_k)

    def _verify_constrained(self, seq: SeqState, tokens: list[int], parents: list[int], depths: list[int],
                            lg: torch.Tensor, start: int) -> tuple[list[int], int]:
        """The walk over a draft tree for a request with a grammar (greedy or sampled; ``lg``:
        [T, vocab] its rows' logits). ``greedy_verify`` asks for the target of node i only after
        i matched its parent's target, in path order: the matcher consumes node i's token then,
        so each target is taken in the grammar state after root..i, as plain decoding takes it
        there. The bonus token is consumed too: the matcher ends the step after every committed
        token."""
        c = seq.constraint
        top = argmax_rows(lg).tolist() if seq.greedy else None   # [T]: the rows' unmasked argmaxes

        def target(i: int) -> int:
            if i:
                c.consume([tokens[i]])   # the walk accepted node i
            return self._target(seq, lg[i], start + depths[i] + 1, None if top is None else top[i])

        path, bonus = greedy_verify(tokens, parents, _LazyTargets(target))
        c.consume([bonus])
        return path, bonus

    @staticmethod
    def _count(seq: SeqState, draft: Draft, depths: list[int], path: list[int]) -> None:
        """Count one verified step in ``seq``'s stats. ``path``: the accepted rows (row 0 the root,
        row i draft node i - 1); tokens are also counted by the source of their node, so a merged
        draft credits each drafter with the tokens it proposed."""
        stats = seq.stats
        n_acc = len(path) - 1
        stats.steps += 1
        stats.draft_depths.append(max(depths) if draft.token_ids else 0)
        if draft.token_ids:
            stats.draft_tokens += len(draft.token_ids)
            stats.accepted_tokens += n_acc
            src = draft.source or "unknown"
            stats.draft_sources[src] = stats.draft_sources.get(src, 0) + 1
            names = draft.node_sources if draft.node_sources is not None else [draft.source] * len(draft.token_ids)
            drafted: dict[str, int] = {}
            for name in names:
                drafted[name or "unknown"] = drafted.get(name or "unknown", 0) + 1
            for name, n in drafted.items():
                stats.source_steps[name] = stats.source_steps.get(name, 0) + 1
                stats.source_drafted[name] = stats.source_drafted.get(name, 0) + n
                stats.source_accepted.setdefault(name, 0)
            for row in path[1:]:
                stats.source_accepted[names[row - 1] or "unknown"] += 1
            seq.tracker.update(draft.score, n_acc)
        stats.acceptance_lengths.append(n_acc + 1)

    def _hit_stop(self, out: list[int], stops: list[str]) -> bool:
        # decode a tail wide enough for the longest stop string (tokens are >= 1 char, but a
        # multi-byte char can span tokens: add slack)
        width = max(len(s) for s in stops) + 8
        return stop_index(self.engine.tokenizer.decode(out[-width:]), stops) >= 0

    def _verify_greedy_batch(self, seqs, segs, layout, logits) -> dict[int, tuple[list[int], int]]:
        """Greedy requests verified at once with ``agentspec.kernels`` (Triton on CUDA, the torch
        reference elsewhere): one device-to-host copy per step. Sampled requests walk their
        accepted path row by row (``seeded_target`` per row on the path)."""
        # (a request with a grammar walks its tree with masked targets: ``_verify_constrained``)
        group = [(s, sg, lay) for s, sg, lay in zip(seqs, segs, layout) if s.greedy and s.constraint is None]
        if not group:
            return {}
        dev = logits.device
        rows, toks, pars, lengths = [], [], [], [0]
        for s, sg, (tokens, parents, depths, T) in group:
            rows.extend(range(sg.offset, sg.offset + T))
            toks += tokens
            pars += parents
            lengths.append(T)
        offsets = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(dev)
        target = argmax_rows(logits)[torch.tensor(rows, device=dev)]   # no copy of the rows' logits
        paths, n, bonus = greedy_verify_batch(torch.tensor(toks, device=dev), torch.tensor(pars, device=dev),
                                              target, offsets)
        paths, n, bonus = paths.tolist(), n.tolist(), bonus.tolist()
        return {id(s): (paths[b][:n[b]], bonus[b]) for b, (s, _, _) in enumerate(group)}


def _chunk(cache: KVCache, start: int, end: int, dtype: torch.dtype) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """A prefix-cache payload: slots ``[start, end)`` of ``cache`` as (k, v) in ``dtype``, and its bytes."""
    k, v = cache.read(start, end, dtype)
    return (k, v), k.nbytes + v.nbytes


class _LazyTargets:
    """``target[i]`` computed when asked: a sampled step needs the target's token only on the
    rows its accepted path visits (``greedy_verify`` reads each of them once)."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[int], int]) -> None:
        self._fn = fn

    def __getitem__(self, i: int) -> int:
        return self._fn(i)


def run_single(decoder: Decoder, seq: SeqState, should_stop: Callable[[], bool] | None = None):
    """One request start to end on ``seq.cache`` (set by the caller): yields the committed tokens
    after every step; returns the Generation. The single-request engine path."""
    try:
        new = decoder.prefill(seq)
        while True:
            added, done = decoder.accept(seq, new)
            if added:
                yield added
            if done:
                break
            if should_stop is not None and should_stop():
                seq.finish = "cancelled"
                break
            draft = decoder.propose(seq)
            new = decoder.step([seq], [draft])[0]
    finally:
        decoder.release(seq)
    return decoder.result(seq)

