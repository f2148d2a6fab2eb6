"""``AgentSpecEagle3Worker``: SGLang's EAGLE-3 worker whose steps may verify the suffix index's draft.

The algorithm ``AGENTSPEC_EAGLE3`` (``--speculative-algorithm AGENTSPEC_EAGLE3`` with
``--speculative-draft-model-path HEAD``): everything SGLang's ``EAGLEWorkerV2`` does (prefill with
the head's draft extend, the head's multi-step draft, the TARGET_VERIFY forward, ``eagle_sample``,
the draft extend over the accepted tokens), except that each decode step's verify tree is chosen
per request by agentspec's drafters through the embedded engine's ``Drafter`` and ``DraftPolicy``:

- ``["suffix", "eagle3"]`` (the default): both trees merged as siblings under the root within the
  verify width, best first by each node's survival (``merge_drafts``, the registry's merge): the
  head is asked when the suffix draft expects fewer than ``FALLBACK_MIN_EXPECTED`` tokens;
- ``"suffix>eagle3"``: ``FallbackDrafter(suffix, head)`` in "switch" mode, i.e. the suffix draft
  when its expected accepted length (``Draft.expected()``) is at least the head's, else the head's
  (ArcticInference's hybrid rule); the head is asked when the suffix draft expects fewer than
  ``FALLBACK_MIN_EXPECTED`` tokens or than the head has been giving the request;
- ``["suffix"]`` / ``["eagle3"]``: one drafter; a request with speculation off gets a root-only row.

The head's confidence per node is its own: the softmax probability of each argmax token of its
top-1 chain (SGLang's topk 1 drafting keeps 1.0 there; the worker reads the draft forwards'
logits, and the draft extend's for the chain's first token, kept in ``topk_p``). Where a forward
was not seen (a CUDA graph ran it), the chain's confidence is the measured one: a decayed mean of
the head's accepted tokens per step, per request (``HeadEstimate``), spread as a geometric
survival.

The head stays in step whichever drafter proposed: SGLang's draft extend after verify runs the
head over the accepted path's tokens with the target's hidden states of those rows (the accepted
path is first gathered to the front of each request's block: KV slots, predictions, hidden states,
as SGLang does for its own trees), so the head's KV cache holds every committed token.

Verify rows are built here for every request (a draft tree's nodes in order, parents first; unused
rows are orphans no walk reaches, so padding is never accepted): ``draft_token [bs*D]``, the
ancestor mask (``QLEN_ONLY`` ``[bs*D*D]`` on CPU, the prefix-wide ``FULL_MASK`` elsewhere),
positions, ``retrieve_index/next_token/next_sibling [bs, D]``. Per step and request the counts by
source (``suffix``, ``eagle3``: drafted, accepted) go into ``req.customized_info`` (``record_step``),
which SGLang returns in ``meta_info``.

Sampled requests: SGLang's CPU verify is greedy; as the AGENTSPEC worker does, verify rows of a
sampled request are replaced by one sample each from the target's distribution (exact ancestral
sampling). On CUDA SGLang's own tree sampling runs.

Limits: overlap scheduling must be off (``--disable-overlap-schedule``; SGLang turns it off on CPU
itself): drafts read each request's committed tokens from ``req.output_ids``. Pipeline
parallelism, grammar-constrained batches and rejection sampling (``--speculative-use-rejection-
sampling``) run SGLang's EAGLE-3 step unchanged (head drafts only).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from sglang.srt.layers.moe.utils import speculative_moe_a2a_backend_context, speculative_moe_backend_context
from sglang.srt.runtime_context import get_parallel, get_spec
from sglang.srt.speculative.eagle_info import EagleVerifyInput
from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
from sglang.srt.utils import is_cpu

from agentspec.drafting import EMPTY_DRAFT, Draft
from agentspec.drafting.registry import build_drafter
from agentspec.kernels.tree import tree_mask, verify_rows

from .worker import SuffixState, record_step, sample_rows_as_argmax

logger = logging.getLogger(__name__)

_is_cpu = is_cpu()

HEAD_SOURCE = "eagle3"
DEFAULT_DRAFTERS = ("suffix", "eagle3")


class TreeVerifyInput(EagleVerifyInput):
    """An EAGLE verify input over an irregular tree of up to ``draft_token_num`` nodes (any depth)."""

    @property
    def max_tree_depth(self) -> int:
        return self.draft_token_num

    @property
    def tree_topk(self) -> int:
        return -1


class HeadEstimate:
    """The head's expected accepted tokens per step: a decayed mean per request over the steps
    that verified its draft, starting from the decayed mean over all requests (``prior``)."""

    def __init__(self, prior: float = 1.0, decay: float = 0.8) -> None:
        self.prior, self.decay = float(prior), float(decay)
        self.per_request: dict[str, float] = {}

    def get(self, rid: str) -> float:
        return self.per_request.get(rid, self.prior)

    def observe(self, rid: str, accepted: int) -> None:
        d = self.decay
        self.per_request[rid] = d * self.get(rid) + (1 - d) * accepted
        self.prior = d * self.prior + (1 - d) * accepted

    def drop(self, rid: str) -> None:
        self.per_request.pop(rid, None)


def geometric_probs(expected: float, length: int) -> list[float]:
    """Per-node probability p of a chain of ``length`` whose survival sum p + p^2 + ... is
    ``expected`` (capped to [0, length))."""
    if length <= 0:
        return []
    e = min(max(expected, 0.0), length - 1e-6)
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        total = sum(mid ** k for k in range(1, length + 1))
        lo, hi = (mid, hi) if total < e else (lo, mid)
    return [lo] * length


def top_probs(logits: torch.Tensor) -> list[float]:
    """Each row's largest softmax probability (the head's confidence in its argmax token)."""
    return torch.softmax(logits.float(), dim=-1).amax(dim=-1).reshape(-1).tolist()


class _Capture:
    """Records what ``runner.forward`` returns while active (the head's logits of each draft
    forward), then puts the runner's own ``forward`` back."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.outputs = runner, []

    def __enter__(self) -> "_Capture":
        runner = self.runner
        self._own = "forward" in vars(runner)
        original = runner.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self.outputs.append(result.logits_output)
            return result

        runner.forward = forward
        self._original = original
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._own:
            self.runner.forward = self._original
        else:
            del self.runner.forward


def chain_probs(first: list[float] | None, steps: list[list[float]], bs: int, length: int) -> list[list[float]] | None:
    """Per request, the head's confidence in each node of its top-1 chain of ``length`` nodes:
    node 0's from the draft extend that chose it (``first``), node k's from draft forward k - 1
    (``steps``). None when a forward ran outside what was captured (e.g. a CUDA graph)."""
    if first is None or len(first) != bs or len(steps) != length - 1 or any(len(s) != bs for s in steps):
        return None
    return [[first[b], *(s[b] for s in steps)] for b in range(bs)]


def head_drafts(verify: EagleVerifyInput, bs: int, width: int,
                confidences: list[list[float]] | None = None) -> list[Draft]:
    """The head's draft tree of each request from SGLang's EAGLE verify input (row 0 the root;
    children by ``retrieve_next_token``, then ``retrieve_next_sibling``), as ``Draft``s: the chain
    of first children (the head's top-1 path) has the head's own softmax confidence per node when
    ``confidences`` gives it (per request, per depth), else probability 1 (``calibrated`` then
    gives it the measured mean); side branches 0 (kept only where the budget leaves room)."""
    tokens = verify.draft_token.view(bs, width).tolist()
    nxt = verify.retrieve_next_token.view(bs, width).tolist()
    sib = verify.retrieve_next_sibling.view(bs, width).tolist()
    out = []
    for b in range(bs):
        ids: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        conf = confidences[b] if confidences is not None else None
        queue = [(0, -1, True, 0)]   # (local node, its index in the draft, on the main chain, depth)
        while queue:
            node, at, main, depth = queue.pop(0)
            child, first = nxt[b][node], True
            while child != -1 and len(ids) < width - 1:
                ids.append(int(tokens[b][child]))
                parents.append(at)
                on_main = main and first
                if not on_main:
                    probs.append(0.0)
                elif conf is not None and depth < len(conf):
                    probs.append(min(max(float(conf[depth]), 0.0), 1.0))
                else:
                    probs.append(1.0)
                queue.append((child, len(ids) - 1, on_main, depth + 1))
                child, first = sib[b][child], False
        out.append(Draft(ids, parents, probs, 0.0, HEAD_SOURCE) if ids else EMPTY_DRAFT)
    return out


def calibrated(d: Draft, expected: float) -> Draft:
    """The head's draft with its main chain's probabilities set so that it expects ``expected``
    accepted tokens (``geometric_probs``); side branches keep probability 0."""
    if not d.token_ids:
        return d
    main = [i for i, p in enumerate(d.probs) if p == 1.0]
    probs = list(d.probs)
    for i, p in zip(main, geometric_probs(expected, len(main))):
        probs[i] = p
    surv = 0.0
    acc = 1.0
    for i in main:
        acc *= probs[i]
        surv += acc
    return Draft(d.token_ids, d.parents, probs, surv, d.source)


class _HeadProposals:
    """The EAGLE-3 head as a ``Drafter`` for one step: ``propose_batch`` runs SGLang's batched head
    draft (``EagleDraftWorker.draft``) the first time a request of the step asks, and returns the
    asked requests' trees. Its lifecycle calls are no-ops: the head's state is SGLang's (its KV
    cache, extended after every verify)."""

    def __init__(self, worker: "AgentSpecEagle3Worker", batch: Any) -> None:
        self.worker, self.batch = worker, batch
        self.verify: EagleVerifyInput | None = None
        self.drafts: dict[str, Draft] = {}
        self.measured = False   # the drafts carry the head's own per-node confidence

    def _run(self) -> None:
        if self.verify is None:
            w, batch = self.worker, self.batch
            bs = len(batch.reqs)
            first = w.first_confidence(batch)
            with w.draft_contexts(), _Capture(w.draft_worker.draft_runner) as cap:
                self.verify = w.draft_worker.draft(batch)
            steps = [top_probs(o.next_token_logits) for o in cap.outputs]
            conf = chain_probs(first, steps, bs, w.speculative_num_steps) if w.head_confidence else None
            self.measured = conf is not None
            by_row = head_drafts(self.verify, bs, w.speculative_num_draft_tokens, conf)
            self.drafts = {req.rid: d for req, d in zip(batch.reqs, by_row)}

    def start(self, req_id: str, prompt: Sequence[int], *, tenant: str = "default") -> None:
        pass

    def extend(self, req_id: str, tokens: Sequence[int]) -> None:
        pass

    def stop(self, req_id: str) -> None:
        pass

    def propose(self, req_id: str, budget: int) -> Draft:
        self._run()
        d = self.drafts.get(req_id, EMPTY_DRAFT).prefix(budget)
        return d if self.measured else calibrated(d, self.worker.head_estimate.get(req_id))

    def propose_batch(self, req_ids: Sequence[str], budgets: Sequence[int]) -> list[Draft]:
        return [self.propose(r, b) for r, b in zip(req_ids, budgets)]


class _Fixed:
    """A drafter whose proposals for this step are already made (the suffix drafts of the step)."""

    def __init__(self, drafts: dict[str, Draft]) -> None:
        self.drafts = drafts

    def propose(self, req_id: str, budget: int) -> Draft:
        return self.drafts.get(req_id, EMPTY_DRAFT).prefix(budget)

    def propose_batch(self, req_ids: Sequence[str], budgets: Sequence[int]) -> list[Draft]:
        return [self.propose(r, b) for r, b in zip(req_ids, budgets)]

    start = extend = stop = _HeadProposals.start


def compose(names: Sequence[str] | None, suffix: Any, head: Any, head_expected: float) -> Any:
    """The step's drafter for a request's drafter list (None: ``DEFAULT_DRAFTERS``, both merged),
    composed by the registry (``build_drafter``) over this step's suffix drafts and head
    proposals. ``head_expected``: the head's expected accepted tokens for this request (a suffix
    draft expecting at least that is final in "switch" mode)."""
    return build_drafter(DEFAULT_DRAFTERS if names is None else names,
                         makers={"suffix": lambda: suffix, HEAD_SOURCE: lambda: head}, head_expected=head_expected)


def tree_rows(draft: Draft, root: int, width: int) -> tuple[list[int], list[int], list[int]]:
    """``(tokens, parents, depths)`` of ``width`` verify rows (``kernels.tree.verify_rows``): the
    root (parent -1, depth 0), the draft's first ``width - 1`` nodes, then orphan rows (parent -2:
    reached by no walk)."""
    return verify_rows(draft.token_ids, draft.parents, root, width, pad="orphan")


def tree_links(parents: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(mask bool[D, D], next_token int64[D], next_sibling int64[D])`` of one request's rows:
    mask[i, j] when j is i or an ancestor of i (an orphan sees only itself); each node's first
    child and next sibling in row order (-1: none)."""
    d = len(parents)
    nxt = np.full(d, -1, dtype=np.int64)
    sib = np.full(d, -1, dtype=np.int64)
    last_child: dict[int, int] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            if p in last_child:
                sib[last_child[p]] = i
            else:
                nxt[p] = i
            last_child[p] = i
    return tree_mask(parents).numpy(), nxt, sib


class AgentSpecEagle3Worker(SuffixState, EAGLEWorkerV2):
    """SGLang's EAGLE-3 worker with agentspec's suffix drafts (see the module docstring)."""

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any) -> None:
        EAGLEWorkerV2.__init__(self, server_args, gpu_id, nccl_port, target_worker)
        self.model_runner = target_worker.model_runner
        self.draft_token_num = self.speculative_num_draft_tokens
        self._init_suffix_state()
        self.head_steps = 0          # steps that ran the head's draft forwards
        self.head_estimate = HeadEstimate()
        self.last_plan: list[Draft] = []
        # the head's softmax confidence per draft node (else its measured mean per request)
        self.head_confidence = os.environ.get("AGENTSPEC_HEAD_CONFIDENCE", "1") != "0"
        if self._tp is not None:
            raise ValueError("AGENTSPEC_EAGLE3 runs with tensor parallelism 1 (use AGENTSPEC or EAGLE3 with --tp > 1)")

    # ---- the decode step -------------------------------------------------------------------------

    def draft_contexts(self) -> Any:
        """The contexts SGLang's EAGLE-3 step runs the head's forwards in."""
        import contextlib

        from sglang.srt.speculative.spec_utils import draft_tp_context

        stack = contextlib.ExitStack()
        stack.enter_context(draft_tp_context(self.draft_worker.parallel_layout))
        stack.enter_context(speculative_moe_backend_context())
        stack.enter_context(speculative_moe_a2a_backend_context())
        return stack

    def _ours(self, batch: Any) -> bool:
        """Whether this step's verify tree is chosen here (else SGLang's EAGLE-3 step runs as is)."""
        fm = batch.forward_mode
        return (self.drafts_here and not (fm.is_extend() or batch.is_extend_in_batch or fm.is_idle())
                and batch.spec_info is not None and not batch.spec_info.is_verify_input()
                and self.speculative_num_steps > 0 and get_parallel().pp_size == 1 and not batch.has_grammar
                and not get_spec().speculative_use_rejection_sampling)

    def forward_batch_generation(self, batch: Any, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        if not self._ours(batch):
            return super().forward_batch_generation(batch, on_publish=on_publish, grammar_barrier=grammar_barrier,
                                                    pp_proxy_tensors=pp_proxy_tensors)
        self.activate_step_by_batch(batch.seq_lens.shape[0])
        verify_input, plan, depth_ok = self._plan(batch)
        batch.spec_info = verify_input
        out = self.verify(batch, pp_proxy_tensors=pp_proxy_tensors, grammar_barrier=grammar_barrier)
        if not depth_ok:
            self._front_accepted_path(batch, out)
        if on_publish is not None:
            on_publish(out.new_seq_lens)
        with self.draft_contexts(), _Capture(self.draft_worker.draft_runner) as cap:
            self.draft_worker._draft_extend_for_decode(batch, out, kv_loc_plan=verify_input.kv_loc_plan)
        self._keep_first_confidence(out, cap.outputs)
        self._record(batch, plan, out)
        return out

    def _keep_first_confidence(self, out: Any, outputs: list) -> None:
        """The head's confidence in the next step's first draft token (the argmax of the draft
        extend's selected row), kept in ``next_draft_input.topk_p`` where SGLang keeps 1.0 for
        topk 1 (SGLang slices and merges it with the batch; topk 1 drafting reads it only as a
        score, and every chain node is verified, so the head's draft is the same)."""
        nxt = getattr(out, "next_draft_input", None)
        if nxt is None or nxt.topk_index is None or nxt.topk_p is None or len(outputs) != 1:
            return
        logits = outputs[0].next_token_logits
        if logits is None or logits.shape[0] != nxt.topk_index.shape[0]:
            return   # the rows were not selected in place (a CUDA graph's path)
        p = torch.tensor(top_probs(logits), dtype=nxt.topk_p.dtype, device=nxt.topk_p.device)
        nxt.topk_p = p.view(nxt.topk_p.shape)

    @staticmethod
    def first_confidence(batch: Any) -> list[float] | None:
        """The head's confidence in each request's first draft token this step (``topk_p`` of the
        draft input: the softmax of the prefill's or the last draft extend's selected row)."""
        info = batch.spec_info
        p = getattr(info, "topk_p", None)
        if p is None or p.dim() == 0 or p.shape[-1] != 1:
            return None
        return p.reshape(-1).tolist()

    def _plan(self, batch: Any) -> tuple[EagleVerifyInput, list[Draft], bool]:
        """Each request's draft for this step and the verify input over them. ``depth_ok``: every
        accepted path is already the front of its block (SGLang's own layout for topk 1)."""
        t0 = time.perf_counter()
        width = self.speculative_num_draft_tokens
        bs = len(batch.reqs)
        current = {req.rid for req in batch.reqs}
        for rid in [rid for rid in self._reqs if rid not in current]:
            self._release(rid)
        roots = batch.spec_info.bonus_tokens.tolist()
        head = _HeadProposals(self, batch)
        suffix_drafts: dict[str, Draft] = {}
        budgets: list[int] = []
        for i, req in enumerate(batch.reqs):
            r = self._reqs.get(req.rid) or self._open(req)
            self._sync(r, list(req.output_ids))
            budget = 0
            if r.spec and width > 1:
                _, budget = self.step_budget(r, req, len(req.output_ids), width)
            budgets.append(budget)
            if budget <= 0:
                continue
            names = r.drafters or DEFAULT_DRAFTERS
            if any("suffix" in n.split(">") for n in names):
                suffix_drafts[req.rid] = self.drafter.propose(req.rid, budget)
        suffix = _Fixed(suffix_drafts)
        plan = [EMPTY_DRAFT] * bs
        for i, req in enumerate(batch.reqs):
            r = self._reqs[req.rid]
            if budgets[i] <= 0:
                continue
            drafter = compose(r.drafters, suffix, head, self.head_estimate.get(req.rid))
            d = drafter.propose_batch([req.rid], [budgets[i]])[0].prefix(budgets[i])
            d.validate(budgets[i])
            plan[i] = self.step_budget(r, req, len(req.output_ids), self.speculative_num_draft_tokens)[0].shape(d)
        if head.verify is not None:
            self.head_steps += 1
        verify = self._verify_input(batch, plan, roots, head.verify)
        depth_ok = all(not d.token_ids or d.parents == list(range(-1, len(d.token_ids) - 1)) for d in plan)
        self.last_plan = plan
        self.steps += 1
        self.draft_seconds += time.perf_counter() - t0
        return verify, plan, depth_ok

    def _verify_input(self, batch: Any, plan: list[Draft], roots: list[int],
                      head_verify: EagleVerifyInput | None) -> EagleVerifyInput:
        from sglang.srt.speculative.eagle_utils import TreeMaskMode, default_tree_mask_mode

        width = self.speculative_num_draft_tokens
        bs = len(plan)
        seq_lens = batch.seq_lens_cpu.tolist() if batch.seq_lens_cpu is not None else batch.seq_lens.tolist()
        tokens = np.zeros(bs * width, dtype=np.int64)
        positions = np.zeros(bs * width, dtype=np.int64)
        nxt = np.zeros((bs, width), dtype=np.int64)
        sib = np.zeros((bs, width), dtype=np.int64)
        masks = []
        for b, d in enumerate(plan):
            t, parents, depths = tree_rows(d, int(roots[b]), width)
            m, n, s = tree_links(parents)
            tokens[b * width:(b + 1) * width] = t
            positions[b * width:(b + 1) * width] = np.asarray(depths) + int(seq_lens[b])
            nxt[b], sib[b] = n, s
            masks.append(m)
        dev = self.device
        attn = self.target_worker.model_runner.attn_backend
        vm = getattr(attn, "verify_mask", None)
        mode = vm.mode if vm is not None else default_tree_mask_mode()
        if mode == TreeMaskMode.QLEN_ONLY:
            custom_mask = torch.from_numpy(np.stack(masks).reshape(-1)).to(dev)
        elif mode == TreeMaskMode.FULL_MASK:
            custom_mask = torch.cat([torch.cat([torch.ones((width, int(seq_lens[b])), dtype=torch.bool),
                                                torch.from_numpy(masks[b])], dim=1).reshape(-1)
                                     for b in range(bs)]).to(dev)
        else:
            raise ValueError(f"AGENTSPEC_EAGLE3: the target attention backend's tree mask mode {mode!r} is not "
                             "supported (QLEN_ONLY or FULL_MASK)")
        retrieve_index = (torch.arange(bs * width, dtype=torch.int64).view(bs, width)).to(dev)
        out = TreeVerifyInput(
            draft_token=torch.from_numpy(tokens).to(dev), custom_mask=custom_mask,
            positions=torch.from_numpy(positions).to(dev), retrieve_index=retrieve_index,
            retrieve_next_token=torch.from_numpy(nxt).to(dev), retrieve_next_sibling=torch.from_numpy(sib).to(dev),
            retrieve_cum_len=None, spec_steps=width - 1, topk=self.topk, draft_token_num=width,
            capture_hidden_mode=None, seq_lens_sum=None, seq_lens_cpu=None)
        if head_verify is not None and head_verify.kv_loc_plan is not None:
            out.kv_loc_plan = head_verify.kv_loc_plan   # the same write window (seq_lens .. + D)
            out.prepared_out_cache_loc = head_verify.prepared_out_cache_loc
        return out

    def verify(self, batch: Any, pp_proxy_tensors=None, grammar_barrier=None):
        if not isinstance(batch.spec_info, TreeVerifyInput) or not _is_cpu or batch.sampling_info.is_all_greedy:
            return super().verify(batch, pp_proxy_tensors=pp_proxy_tensors, grammar_barrier=grammar_barrier)
        # CPU verify is greedy: make each sampled request's verify rows one sample of the target
        tw = self._target_worker
        original = tw.forward_batch_generation
        width = self.speculative_num_draft_tokens

        def sampled(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if kwargs.get("is_verify"):
                sample_rows_as_argmax(result.logits_output.next_token_logits, batch, width, self.sampled_flags(batch))
            return result

        tw.forward_batch_generation = sampled
        try:
            return super().verify(batch, pp_proxy_tensors=pp_proxy_tensors, grammar_barrier=grammar_barrier)
        finally:
            tw.forward_batch_generation = original

    def _front_accepted_path(self, batch: Any, out: Any) -> None:
        """Gather each request's accepted path to the front of its block (KV slots, predictions,
        hidden states): what SGLang's draft extend and KV bookkeeping read. SGLang does this
        itself only for topk > 1; a suffix tree under topk 1 needs it too."""
        if self.topk > 1:
            return   # run_eagle_verify did it
        from sglang.srt.speculative.eagle_worker_common import _finalize_accept_tree_path

        out.next_token_ids = _finalize_accept_tree_path(
            batch, out.accept_index, out.accept_lens, out.next_token_ids, out.logits_output, len(batch.seq_lens),
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            num_draft_tokens=self.speculative_num_draft_tokens)
        out.prepared_draft_extend_inputs = None   # a chain layout's; the draft extend recomputes them

    def _record(self, batch: Any, plan: list[Draft], out: Any) -> None:
        accept_lens = out.accept_lens.tolist()
        accept_index = out.accept_index.tolist()
        width = self.speculative_num_draft_tokens
        for b, (req, d) in enumerate(zip(batch.reqs, plan)):
            n_acc = int(accept_lens[b]) - 1
            counts: dict[str, list[int]] = {}
            n = min(len(d.token_ids), width - 1)
            for i in range(n):
                counts.setdefault(d.source_of(i) or "unknown", [0, 0])[0] += 1
            for flat in accept_index[b][1:n_acc + 1]:
                node = int(flat) - b * width - 1   # row j is draft node j - 1
                if 0 <= node < n:
                    counts[d.source_of(node) or "unknown"][1] += 1
            record_step(req, {k: (v[0], v[1]) for k, v in counts.items()}, n_acc)
            if HEAD_SOURCE in counts:
                self.head_estimate.observe(req.rid, counts[HEAD_SOURCE][1])

    def _release(self, rid: str) -> None:
        self.head_estimate.drop(rid)
        super()._release(rid)

    def clear_cache_pool(self) -> None:
        self.release_all()
        parent = getattr(super(), "clear_cache_pool", None)
        if callable(parent):
            parent()


__all__ = ["AgentSpecEagle3Worker", "DEFAULT_DRAFTERS", "HEAD_SOURCE", "HeadEstimate", "TreeVerifyInput", "calibrated",
           "chain_probs", "top_probs",
           "compose", "geometric_probs", "head_drafts", "tree_links", "tree_rows"]
