"""``AgentSpecWorker``: SGLang's NGRAM worker, drafting from agentspec's suffix index.

It runs inside SGLang's scheduler process (one per tensor/data-parallel rank) and fills NGRAM's
draft contract from agentspec's index instead of NGRAM's corpus: per decode step,
``_prepare_draft_tokens(batch)`` returns ``tokens int64[bs*D]`` (each request's row starts with
its last committed token) and the ancestor-or-self ``mask bool[bs*D*D]``; everything after that
(tree positions, the TARGET_VERIFY forward, verification, KV bookkeeping, overlap scheduling) is
SGLang's own code.

The draft state lives here, in this process:
- one ``SuffixIndex``: each running request's whole context (prompt + committed tokens), each
  tenant's earlier outputs, each request's Predicted Output (a tenant-scoped document while it
  runs) and each tenant's workspace documents;
- one ``Workspace`` per configured tenant folder, kept current by a file watcher
  (``SchedulerConfig`` from ``$AGENTSPEC_SGLANG``).

Drafts go through the same ``SuffixDrafter`` (``agentspec.drafting``) and ``DraftPolicy``
(``agentspec.decode.policy``: the budget, capped by the tokens the request has left) as the
embedded engine's. Per-request policy comes in ``sampling_params.custom_params``
(``config.request_params``): tenant, speculation on/off, budget, prediction. A request with speculation off gets a root-only
row (SGLang has no per-request off switch; its width is fixed per batch).

Padding. SGLang verifies a fixed width D (``--speculative-num-draft-tokens``) for every request
in a batch; a draft with fewer nodes is padded NGRAM's way: token 0 as a child of the root. The
padded rows cost the same verify compute as real ones (the forward is D rows per request
whatever they hold), so the worker always proposes up to D-1 nodes.

Sampling on CPU. SGLang's CPU verify is greedy for every request (``_verify_uses_greedy``:
``is_cpu``), which would turn a sampled request greedy. For a sampled request in a batch on CPU
the worker samples each verify row from the target's own distribution (temperature, top-k,
top-p, min-p) and makes that token the row's argmax; the greedy tree walk then accepts a draft
token exactly when the target sampled it, which is exact ancestral sampling of the target (the
draft only decides which samples can be used in one step). On CUDA SGLang samples verify rows
itself (target-only tree sampling, exact), and the worker leaves the logits alone.

Tensor parallelism. Every TP rank runs this worker; rank 0 drafts and broadcasts its rows to the
others (workspace events reach ranks at different times, so ranks must not draft on their own).
Data parallelism: each DP rank is a scheduler with its own index; a tenant's history is where
its requests land (route by tenant with sglang-router's session affinity).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import numpy as np
import torch

from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.runtime_context import get_device, get_schedule, get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.ngram_worker import NGRAMWorker
from sglang.srt.utils import is_cpu

from agentspec.config import SpecConfig
from agentspec.decode.policy import DraftPolicy
from agentspec.kernels.tree import tree_mask, verify_rows

from .config import (
    SOURCE_KEY,
    SchedulerConfig,
    read_request_drafters,
    read_request_greedy,
    read_request_params,
    source_record,
)

logger = logging.getLogger(__name__)

_is_cpu = is_cpu()


def prediction_doc_id(rid: str) -> str:
    return f"prediction\x1f{rid}"


def draft_rows(tokens: list[int], parents: list[int], root: int, width: int) -> tuple[list[int], list[int]]:
    """A draft tree (``Draft.token_ids``/``parents``, parent -1 = the root) as ``width`` verify
    rows (``kernels.tree.verify_rows``): the root token first, then the draft's first ``width-1``
    nodes (parents precede children, so any prefix is a tree), then padding NGRAM's way (token 0,
    a child of the root)."""
    rows, par, _ = verify_rows(tokens, parents, root, width, pad="root_child")
    return rows, par


def ancestor_mask(parents: list[int]) -> np.ndarray:
    """``mask[i, j]`` = 1 when node j is node i or one of its ancestors (parents precede children)."""
    return tree_mask(parents).numpy()


class _Req:
    __slots__ = ("rid", "req", "tenant", "spec", "budget", "doc", "known", "sampled", "drafters")

    def __init__(self, rid: str, req: Any, tenant: str, spec: bool, budget: int | None, doc: str | None,
                 known: int, sampled: bool, drafters: tuple[str, ...] | None = None) -> None:
        self.rid, self.req, self.tenant, self.spec, self.budget = rid, req, tenant, spec, budget
        self.doc, self.known, self.sampled, self.drafters = doc, known, sampled, drafters


def record_step(req: Any, counts: dict[str, tuple[int, int]], accepted: int) -> None:
    """Write one verify step's ``{source: (drafted, accepted)}`` into ``req.customized_info``
    (``SOURCE_KEY``: one entry per output token, this step's on its first token), which SGLang
    returns in ``meta_info``. Called after verify, before the step's ``accepted + 1`` tokens join
    ``req.output_ids``."""
    info = req.customized_info
    if info is None:
        info = req.customized_info = {}
    values = info.setdefault(SOURCE_KEY, [])
    have = len(req.output_ids)
    if len(values) < have:   # the prefill's token, or steps before this worker saw the request
        values.extend([None] * (have - len(values)))
    values.append(source_record(counts) if counts else None)
    values.extend([None] * accepted)


class _NoCorpus:
    """What NGRAMWorker's own code still calls on ``self.ngram_corpus`` (the erase of departed
    requests after verify, the reset on a cache flush). The suffix index replaces the corpus;
    departed requests are released by ``AgentSpecWorker`` itself."""

    def __init__(self, worker: "AgentSpecWorker") -> None:
        self._worker = worker

    def synchronize(self) -> None:
        pass

    def batch_put(self, batch_tokens: Any) -> None:
        pass

    def erase_match_state(self, req_ids: Any) -> None:
        pass

    def reset(self) -> None:
        self._worker.release_all()

    def load_external_corpus_named(self, *a: Any, **k: Any) -> Any:
        raise NotImplementedError("the AGENTSPEC algorithm drafts from workspaces, not NGRAM's external corpus: "
                                  "configure tenants' workspaces instead")

    commit_external_corpus_load = remove_external_corpus = load_external_corpus_named

    def list_corpora(self) -> dict[str, int]:
        return {}


class SuffixState:
    """The draft state both agentspec workers keep in SGLang's scheduler process: the suffix
    index, the tenants' workspaces, and one ``_Req`` per running request (its tenant, policy,
    prediction document and the tokens the index has seen). ``_init_suffix_state`` after the
    SGLang worker's own ``__init__``; ``self.model_runner`` must be the target's."""

    def _init_suffix_state(self) -> None:
        self.config = SchedulerConfig.from_env()
        self._tp = self._tp_group()
        self.drafts_here = self._tp is None or self._tp.rank_in_group == 0
        self._reqs: dict[str, _Req] = {}
        self.workspaces: list[Any] = []
        self.index = None
        if self.drafts_here:
            self._build_index()
        self.steps = 0
        self.draft_seconds = 0.0

    @staticmethod
    def _tp_group() -> Any:
        try:
            from sglang.srt.runtime_context import get_parallel

            g = get_parallel().tp_group
        except Exception:  # noqa: BLE001 - no parallel context: one rank
            return None
        return g if g is not None and getattr(g, "world_size", 1) > 1 else None

    def _build_index(self) -> None:
        from suffix_index import SuffixIndex

        from agentspec.drafting import SuffixDrafter

        vocab = int(self.model_runner.model_config.vocab_size)
        self.index = SuffixIndex(vocab_size=vocab, keep_outputs=self.config.history)
        # drafts go through the same Drafter and DraftPolicy as the embedded engine's
        self.drafter = SuffixDrafter(self.index)
        if not self.config.tenants:
            return
        from agentspec.backends.tokenizer import Tokenizer
        from agentspec.workspace import OwnedPath, Workspace
        from pathlib import Path

        if self.config.tokenizer is None:
            raise ValueError("AGENTSPEC: workspaces are configured but no tokenizer folder ($AGENTSPEC_SGLANG)")
        tok = Tokenizer.load(Path(self.config.tokenizer))
        for t in self.config.tenants:
            if t.workspace is None:
                continue
            t0 = time.perf_counter()
            ws = Workspace(t.workspace, tenant=t.name, index=self.index, tokenizer=tok, watch=self.config.watch,
                           exclude=[OwnedPath.of(rule, path) for rule, path in self.config.exclude], progress=False)
            s = ws.summary()
            print(f"[agentspec] scheduler: indexed workspace {t.workspace} for tenant {t.name!r}: {s['files']} "
                  f"files, {s['chunks']} chunks, {s['tokens']} tokens in {time.perf_counter() - t0:.1f}s",
                  file=sys.stderr, flush=True)
            self.workspaces.append(ws)

    def release_all(self) -> None:
        for rid in list(self._reqs):
            self._release(rid)

    def _release(self, rid: str) -> None:
        r = self._reqs.pop(rid, None)
        if r is None or self.index is None:
            return
        try:
            self._sync(r, list(r.req.output_ids))   # its last accepted tokens join the tenant's history
            self.drafter.stop(rid)
        finally:
            if r.doc is not None:
                self.index.remove_document(r.doc)

    def _open(self, req: Any) -> _Req:
        sp = req.sampling_params
        custom = getattr(sp, "custom_params", None)
        tenant, spec, budget, prediction = read_request_params(custom)
        drafters = read_request_drafters(custom)
        prompt = list(req.origin_input_ids_unpadded)
        sampled = not read_request_greedy(custom, sp)
        doc = None
        if self.index is not None:
            try:
                self.drafter.start(req.rid, prompt, tenant=tenant)
            except ValueError as e:   # custom_params from a client other than agentspec serve
                logger.warning("AGENTSPEC: request %s drafts nothing: %s", req.rid, e)
                tenant, spec, prediction = "default", False, None
                self.drafter.start(req.rid, prompt)
            if prediction and spec:
                doc = prediction_doc_id(req.rid)
                try:
                    self.index.add_document(doc, prediction, tenant=tenant)
                except ValueError as e:   # a token id outside the vocabulary: no prediction, no crash
                    logger.warning("AGENTSPEC: request %s: prediction ignored: %s", req.rid, e)
                    doc = None
        r = _Req(req.rid, req, tenant, spec, budget, doc, len(prompt), sampled, drafters)
        self._reqs[req.rid] = r
        return r

    def step_budget(self, r: _Req, req: Any, produced: int, width: int) -> tuple[DraftPolicy, int]:
        """The request's draft policy (``DraftPolicy.for_request``, as the embedded engine builds
        it: the request's budget, else the configured default, capped by the ``width - 1`` draft
        rows SGLang verifies; no cost cut, SGLang verifies the whole width anyway) and its budget
        this step (capped by the tokens it has left after ``produced``)."""
        spec = SpecConfig(budget=self.config.default_budget if r.budget is None else r.budget) if r.spec else None
        policy = DraftPolicy.for_request(spec, row_cost=0.0, max_rows=width)
        left = getattr(req.sampling_params, "max_new_tokens", None)
        return policy, policy.budget if left is None else policy.budget_for(left - produced)

    def sampled_flags(self, batch: Any) -> list[bool]:
        """Per request of ``batch``: whether it samples (decided when it was opened, from what the
        request says: ``read_request_greedy``)."""
        return [self._reqs[req.rid].sampled if req.rid in self._reqs
                else not read_request_greedy(getattr(req.sampling_params, "custom_params", None), req.sampling_params)
                for req in batch.reqs]

    def _sync(self, r: _Req, committed_out: list[int]) -> None:
        """Extend the index with the request's committed tokens it has not seen yet."""
        prompt_len = len(r.req.origin_input_ids_unpadded)
        have = r.known - prompt_len
        if len(committed_out) > have:
            self.drafter.extend(r.rid, committed_out[have:])
            r.known = prompt_len + len(committed_out)

class AgentSpecWorker(SuffixState, NGRAMWorker):
    """NGRAM's verify machinery with agentspec's drafts (see the module docstring)."""

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any) -> None:
        # NGRAMWorker.__init__ builds NGRAM's C++ corpus (a JIT build we have no use for): set the
        # same attributes here instead.
        BaseSpecWorker.__init__(self)
        spec = get_spec()
        self.server_args = server_args
        self.enable_overlap = not get_schedule().disable_overlap_schedule
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.page_size = get_schedule().page_size
        self.draft_token_num: int = spec.speculative_num_draft_tokens
        self.max_trie_depth: int = spec.speculative_ngram_max_trie_depth
        self.speculative_num_draft_tokens = spec.speculative_num_draft_tokens
        self.topk = spec.speculative_eagle_topk
        self.speculative_num_steps = spec.speculative_num_steps
        self.device = get_device().device
        self.adaptive_controller = None
        self._prev_decode_rids: set = set()
        self.grammar_tree_host = None
        self.ngram_corpus = _NoCorpus(self)

        self._init_suffix_state()
        self._wrap_verify_sampling()
        self._step_drafted: list[tuple[Any, int]] | None = None

    # ---- NGRAM's draft contract ----------------------------------------------------------------------

    def _prepare_draft_tokens(self, batch: ScheduleBatch) -> tuple[np.ndarray, np.ndarray]:
        bs = len(batch.reqs)
        width = self.draft_token_num
        use_prev_tokens = self.enable_overlap and not batch.grammar_needs_sync()
        if use_prev_tokens:
            prev_ids, prev_lens = batch.spec_info.accept_tokens, batch.spec_info.accept_lens
            if not prev_ids.is_cpu:
                prev_ids, prev_lens = prev_ids.cpu(), prev_lens.cpu()
            self.prev_token_ids, self.prev_accept_lens = prev_ids.tolist(), prev_lens.tolist()
        else:
            self.prev_token_ids, self.prev_accept_lens = [], [0] * bs

        if not self.drafts_here:
            out = self._tp.broadcast_object(None, src=0)
            return out
        t0 = time.perf_counter()
        current = {req.rid for req in batch.reqs}
        for rid in [rid for rid in self._reqs if rid not in current]:
            self._release(rid)   # finished or aborted: its output joins its tenant's history
        tokens = np.zeros(bs * width, dtype=np.int64)
        mask = np.zeros((bs, width, width), dtype=bool)
        drafted: list[tuple[Any, int]] = []
        for i, req in enumerate(batch.reqs):
            r = self._reqs.get(req.rid) or self._open(req)
            out = list(req.output_ids)
            if use_prev_tokens:
                n = self.prev_accept_lens[i]
                out += self.prev_token_ids[i * width: i * width + n]
            self._sync(r, out)
            root = out[-1] if out else int(req.origin_input_ids_unpadded[-1])
            d_tokens: list[int] = []
            d_parents: list[int] = []
            if r.spec and width > 1:
                policy, budget = self.step_budget(r, req, len(out), width)
                if budget > 0:
                    d = self.drafter.propose(r.rid, budget)
                    d.validate(budget)
                    d = policy.shape(d)
                    d_tokens, d_parents = d.token_ids, d.parents
            rows, parents = draft_rows(d_tokens, d_parents, root, width)
            drafted.append((req, min(len(d_tokens), width - 1)))
            tokens[i * width:(i + 1) * width] = rows
            mask[i] = ancestor_mask(parents)
        flat = mask.reshape(-1)
        self._step_drafted = drafted
        self.steps += 1
        self.draft_seconds += time.perf_counter() - t0
        if self._tp is not None:
            self._tp.broadcast_object((tokens, flat), src=0)
        return tokens, flat

    def forward_batch_generation(self, batch: ScheduleBatch, *args: Any, **kwargs: Any) -> Any:
        """NGRAM's step, then each request's draft counts (source "suffix") into its
        ``customized_info`` (``record_step``). A padding row accepted (the target's token happened
        to be the pad) is not a suffix token: accepted counts are capped at the drafted ones."""
        self._step_drafted = None
        result = super().forward_batch_generation(batch, *args, **kwargs)
        drafted, self._step_drafted = self._step_drafted, None
        lens = getattr(result, "accept_lens", None)
        if drafted and lens is not None and len(drafted) == len(lens):
            for (req, n), acc in zip(drafted, lens.tolist()):
                acc = int(acc) - 1
                record_step(req, {"suffix": (n, min(acc, n))} if n else {}, acc)
        return result

    def _update_ngram_corpus(self, batch: ScheduleBatch) -> None:
        """NGRAM inserts n-grams here; the index takes committed tokens at the next draft."""

    def clear_cache_pool(self) -> None:
        self.release_all()
        self._prev_decode_rids = set()

    # ---- exact sampling on the CPU verify path -------------------------------------------------

    def _wrap_verify_sampling(self) -> None:
        if not _is_cpu:
            return
        tw = self._target_worker
        original = tw.forward_batch_generation

        def forward_batch_generation(batch: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(batch, *args, **kwargs)
            if kwargs.get("is_verify") and not batch.sampling_info.is_all_greedy:
                sample_rows_as_argmax(result.logits_output.next_token_logits, batch, self.draft_token_num,
                                      self.sampled_flags(batch))
            return result

        tw.forward_batch_generation = forward_batch_generation


def sample_rows_as_argmax(logits: torch.Tensor, batch: Any, width: int, sampled: list[bool]) -> None:
    """For each sampled request of ``batch`` (``sampled``, per request), draw one token per verify row with
    SGLang's own sampler (``top_k_top_p_min_p_sampling_from_probs_torch``: the same temperature,
    top-k, top-p, min-p and, for a seeded request, the same position-keyed randomness as its
    plain decode step), after the logit adjustments ``eagle_sample`` applies, and overwrite the
    row so that token is its argmax (0 there, -inf elsewhere). Greedy rows stay as they are."""
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

    info = batch.sampling_info
    positions = batch.spec_info.positions
    for i, req in enumerate(batch.reqs):
        if not sampled[i]:
            continue
        sl = slice(i * width, (i + 1) * width)
        rows = logits[sl].float()
        for extra in (info.acc_additive_penalties, info.logit_bias):
            if extra is not None:
                rows = rows + extra[i]
        if info.acc_scaling_penalties is not None:
            s = info.acc_scaling_penalties[i]
            rows = torch.where(rows > 0, rows / s, rows * s)
        probs = torch.softmax(rows / info.temperatures[i], dim=-1)
        rep = (lambda t: t[i].reshape(1).expand(width).contiguous())
        seed = None if info.sampling_seed is None else rep(info.sampling_seed)
        picked = top_k_top_p_min_p_sampling_from_probs_torch(
            probs, rep(info.top_ks), rep(info.top_ps), rep(info.min_ps), info.need_min_p_sampling, seed,
            positions[sl])
        out = torch.full_like(logits[sl], float("-inf"))
        out.scatter_(1, picked.long().view(-1, 1), 0.0)
        logits[sl] = out
