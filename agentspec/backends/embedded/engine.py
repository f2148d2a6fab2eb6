"""The embedded engine: torch on CPU or one CUDA GPU, exact tree speculation, one request at a time.

One decode step (DESIGN.md section 4): the drafter proposes a tree; the model runs one forward
over ``[last committed token] + draft`` with a tree attention mask; greedy verification keeps the
longest path the target agrees with plus the bonus token; the KV cache keeps the accepted path.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypedDict, Unpack

import torch

from ...config import DEFAULT_SPEC, SpecConfig, check_drafters
from ...drafting import Drafter, default_drafter
from ...errors import ConfigError, InvalidRequestError, ModelLoadError
from ...kernels import cpu_linear
from ...kernels import cpu_isa as _cpu_isa
from ..protocol import GenerationRequest, OutputFormat, check_request
from ...decode.results import Generation
from .model import KVCache, Transformer, round_up
from .plan import KernelPlan, Settings
from .prefix_cache import CHUNK_TOKENS, PrefixCache
from .spec_device import spec_off_reason
from .step_profile import StepProfile
from ...decode.step import Decoder, run_single
from .threads import ThreadGovernor
from ..tokenizer import Tokenizer
from .weights import bundled_model_path, load_checkpoint

__all__ = ["EmbeddedEngine", "GenerateOptions"]


class GenerateOptions(TypedDict, total=False):
    """``EmbeddedEngine.generate``'s keyword options beyond ``max_tokens``, ``temperature`` and ``spec``."""

    top_p: float                    # nucleus sampling mass in (0, 1]
    top_k: int                      # 0: no top-k cut
    seed: int | None                # sampled requests: same seed, same tokens
    stop: str | Sequence[str] | None
    drafter: Drafter | None         # default: what spec.drafters names, else the engine's drafter
    tenant: str                     # whose history and workspace drafts come from
    should_stop: Callable[[], bool] | None
    grammar: str | None             # an llguidance grammar the output must follow (``GenerationRequest.grammar``)
    output: OutputFormat | None     # how the output reads, for drafters (``GenerationRequest.output``)


class EmbeddedEngine:
    """Torch engine for the families in ``agentspec.backends.embedded.families`` (Llama, Mistral, Qwen2, Qwen3).

    Options (keyword-only):
      model: a ``.gguf`` file or Hugging Face folder; None = the bundled SmolLM2-135M-Instruct.
      device: "cpu" (default) or "cuda".
      dtype: torch dtype or its name; default bfloat16 (on CPU wherever the native kernels are
        built: their decode / verify linears and attention run as the AVX512-BF16 instruction or an
        emulation of it with the same bits: AVX-512, AVX2 + FMA, NEON, scalar; see
        ``agentspec.kernels.cpu_isa``), float32 on a CPU without them.
      cpu_isa: cap the native kernels' ISA ("avx512bf16", "avx512", "avx2", "neon", "scalar");
        default ``$AGENTSPEC_CPU_ISA`` or the best this CPU runs. Below AVX512-BF16, prefill
        multiplies in float32 (torch's bfloat16 GEMM is slow without bf16 instructions).
      kv_dtype: KV cache dtype. Default bfloat16 where it gives the same bits as float32 (a
        bfloat16 model on CPU whose decode / verify rows take the layered path's native attention:
        the GGUF models but SmolLM2's fused path), else float32. bfloat16 halves the cache and the
        bytes a long-context decode step reads; exact where the native attention reads it (the
        kernel plan's "native" / "dot" rows attention: CPU, head_dim 64 or 128, layered rows), not
        on the torch fallback (its bf16 GEMMs re-block by shape: 2 of 6 rewrites diverged there).
      max_context: context window in tokens; default the model's (capped at 8192).
      deterministic: pad every decode forward to fixed shapes (``deterministic_width`` rows,
        a per-request fixed key length) and verify linear drafts only, so that a token's logits
        never depend on what else shares the forward: greedy speculation then equals plain
        decoding by construction. Costs time per plain step; see README "Exactness".
      drafter: the Drafter to use; default ``agentspec.drafting.default_drafter()``.
      workspace: an ``agentspec.Workspace``: requests of its tenant also draft from its files.
      threads: torch CPU threads (default: ``$OMP_NUM_THREADS``, else the cores this process may use:
        affinity and cgroup quota, ``agentspec.kernels.cpu_isa.usable_cpus``).
      row_cost: cost of one more verified token relative to a decode step; drafts are cut to
        the prefix that maximises expected tokens per step cost (``cut_for_cost``). Default:
        profiled at start-up on this machine (~0.07 on 2 CPU cores; near 0 on a GPU).
      quiet: no progress or log lines on stderr.
      eagle3: an EAGLE-3 head directory (SGLang layout) for the ``"eagle3"`` drafter; default
        ``$AGENTSPEC_EAGLE3``, else the head shipped for the bundled model.
      prefix_cache_bytes: memory for the prefix cache (``agentspec.backends.embedded.prefix_cache``): prompt
        KV that later requests sharing a prefix reuse; None (default): min(25% of RAM, 4 GiB);
        0: off. Less than one full-context prompt's KV raises ConfigError.
      prefix_cache_shared: one prefix cache for every tenant (default False: one per tenant, so
        a tenant's timing cannot probe another's prompts).
      eagle3_gate: whether the head's per-request break-even gate runs (default True, or
        ``$AGENTSPEC_EAGLE3_GATE=0``: off, the head drafts whenever it is asked: a machine where
        it is known to pay, or a test that needs it to draft).
      speculate_on_cuda: speculate on CUDA although verification is not row-invariant there
        (greedy output may then differ from plain decoding where the top two logits nearly tie).
        Default ``$AGENTSPEC_CUDA_SPECULATION``, else off on CUDA unless ``deterministic``;
        each request's ``spec_reason`` says so (``spec_device``). No effect on CPU.
    """

    # the canonical prefill chunk (``prefix_cache.CHUNK_TOKENS``): prompts are prefilled in chunks at
    # multiples of it, so a prefix-cache hit and a prefill compute the same bits (``decode.step``)
    chunk_tokens = CHUNK_TOKENS

    def __init__(
        self,
        *,
        model: str | None = None,
        device: str = "cpu",
        dtype: str | torch.dtype | None = None,
        kv_dtype: str | torch.dtype | None = None,
        max_context: int | None = None,
        deterministic: bool = False,
        deterministic_width: int = 33,
        drafter: Drafter | None = None,
        workspace: Any = None,
        threads: int | None = None,
        row_cost: float | None = None,
        quiet: bool = False,
        cpu_isa: str | None = None,
        eagle3: str | os.PathLike | None = None,
        eagle3_gate: bool | None = None,
        prefix_cache_bytes: int | None = None,
        prefix_cache_shared: bool = False,
        speculate_on_cuda: bool | None = None,
        weights: str | None = None,
        draft_model: str | os.PathLike | None = None,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} requested but CUDA is not available")
        try:
            _cpu_isa.set_isa(cpu_isa) if cpu_isa is not None else _cpu_isa.apply_env()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        try:
            settings = Settings.from_env()   # what the environment asks of the kernels (the plan decides)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if dtype is None:
            native = (self.device.type == "cpu" and settings.native_linears and settings.native_attention
                      and cpu_linear.linear_supported(torch.bfloat16, self.device))
            dtype = torch.bfloat16 if self.device.type == "cuda" or native or cpu_has_fast_bf16() else torch.float32
        else:
            dtype = _dtype(dtype, "dtype")
        if threads is not None:
            torch.set_num_threads(int(threads))
        elif self.device.type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(_cpu_isa.usable_cpus())  # affinity and cgroup quota, not all cores
        # decode steps use the cores other processes leave free (up to the count above)
        self.governor = ThreadGovernor(torch.get_num_threads(), enabled=self.device.type == "cpu"
                                       and os.environ.get("AGENTSPEC_THREAD_GOVERNOR", "1") != "0")
        if row_cost is not None and (isinstance(row_cost, bool) or not isinstance(row_cost, (int, float))
                                     or not 0.0 <= row_cost <= 10.0):
            raise ConfigError(f"row_cost must be a number in [0, 10], got {row_cost!r}")
        if deterministic_width < 2:
            raise ConfigError(f"deterministic_width must be >= 2, got {deterministic_width}")
        self.dtype = dtype
        self.kv_dtype = torch.float32 if kv_dtype is None else _dtype(kv_dtype, "kv_dtype")
        self.quiet = quiet
        self.eagle3 = None if eagle3 is None else str(eagle3)
        self.eagle3_gate = (os.environ.get("AGENTSPEC_EAGLE3_GATE", "1") != "0") if eagle3_gate is None \
            else bool(eagle3_gate)
        _weight_copies_setting()   # a bad value fails before the weights load
        quant = self._quantized_weights(weights, model, settings, dtype)
        t0 = time.perf_counter()
        ckpt = load_checkpoint(model, quiet=quiet, quantized=quant)
        self.args = ckpt.args
        self.model_path = ckpt.source
        # the bundled model (its EAGLE-3 head ships with agentspec: drafting.eagle3_drafter)
        self.runs_bundled_model = model is None or _same_file(ckpt.source, bundled_model_path)
        self.draft_heads: dict = {}   # EAGLE-3 heads loaded for this model, by path (eagle3_drafter.for_engine)
        self.tokenizer: Tokenizer = ckpt.tokenizer
        self.model = Transformer(ckpt.args, init_weights=False)  # every weight is loaded next
        self.model.set_kernel_settings(settings)
        self.model.set_kv_dtype(self.kv_dtype)
        if quant:
            self.model.drop_projections()   # they come quantized, below
        # to the device and dtype first (the parameters are still empty), then the checkpoint's
        # tensors one at a time, each converted as it is copied in: no second copy of the model
        self.model.to(device=self.device, dtype=dtype)
        ckpt.load_into(self.model, projections=not quant)
        if quant:
            self.model.set_quantized(_repack(ckpt, quiet))
        self.model.rope_cos = self.model.rope_cos.float()
        self.model.rope_sin = self.model.rope_sin.float()
        self.model.eval()
        if self.device.type == "cpu" and not quant:
            # decode rows: native row-invariant bf16 linears where they run
            self.model.pack_linears(keep_weights=self._keep_weight_copy())
            # prefill: torch's GEMM, in float32 where the CPU has no bf16 dot products
            self.model.set_gemm_float32(dtype == torch.bfloat16 and not _cpu_isa.bf16_native())
        if kv_dtype is None and self._bfloat16_cache_is_exact():
            # the model's keys and values are bfloat16 values and the native attention reads a
            # bfloat16 cache as the floats it holds: the same bits in half the bytes
            self.kv_dtype = torch.bfloat16
            self.model.set_kv_dtype(self.kv_dtype)
        self.max_context = min(max_context or min(ckpt.args.max_seq_len, 8192), ckpt.args.max_seq_len)
        self.deterministic = deterministic
        self.deterministic_width = deterministic_width
        # speculation's default on this device: off on CUDA unless exact or opted in (spec_device)
        self.spec_off_reason = spec_off_reason(self.device.type, deterministic=deterministic, opt_in=speculate_on_cuda)
        if self.spec_off_reason and not quiet:
            print(f"[agentspec] speculation {self.spec_off_reason}", file=sys.stderr, flush=True)
        self.prefix_cache: PrefixCache | None = None
        self.configure_prefix_cache(prefix_cache_bytes, shared=prefix_cache_shared)   # ConfigError: before warm-up
        if drafter is not None and workspace is not None:
            raise ConfigError("pass either drafter or workspace, not both")
        self.workspace = workspace
        self.drafter: Drafter = drafter if drafter is not None else default_drafter(workspace=workspace)
        self._cache: KVCache | None = None
        self._lock = threading.Lock()
        # (SpecConfig.drafters, id(index)) -> built once (the index lives as long as its drafter)
        self._named_drafters: dict[tuple[tuple[str, ...], int], Drafter] = {}
        self._named_lock = threading.Lock()
        self._constraints: Any = None   # the grammar compiler (``constraint_for``), built on the first grammar
        # the step-cost profile (step_profile): its row cost now, the rest of its grid in the
        # batch scheduler's idle time
        self.step_profile = StepProfile(self, base=1 if self.model.row_invariant(self.new_cache(256)) else 2)
        cached = self.step_profile.row_cost() is not None
        self.row_cost = float(row_cost) if row_cost is not None else self.step_profile.start()
        row_cost_note = " (cached)" if row_cost is None and cached else ""
        self.decoder = Decoder(self)
        self.draft_engine: EmbeddedEngine | None = None
        if draft_model is not None:
            self.draft_engine = self._load_draft_model(draft_model, device=device, quiet=quiet)
        self.load_seconds = time.perf_counter() - t0
        if not quiet:
            n = self.model.param_count()
            print(f"[agentspec] model ready: {n / 1e6:.0f}M parameters, {str(dtype).removeprefix('torch.')} "
                  f"on {self.device} ({self.hardware_summary()}), context {self.max_context}, row cost {self.row_cost:.3f}{row_cost_note} ({self.load_seconds:.1f}s)",
                  file=sys.stderr, flush=True)

    def _bfloat16_cache_is_exact(self) -> bool:
        """Whether a bfloat16 KV cache gives this model the bits a float32 one does: a bfloat16
        model on CPU whose decode / verify rows take the layered path's native attention (which
        reads a bfloat16 cache as the floats it holds; prompts' attention reads the keys in
        bfloat16 either way). The fused path keeps float32 (its packed copies), as does the torch
        fallback (its GEMMs would run in bfloat16)."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16:
            return False
        plan = self.model.plan()
        return not plan.fused and plan.layered_attention == "native"

    @property
    def prefix_cache_dtype(self) -> torch.dtype:
        """The dtype the prefix cache stores KV in: the model's when it is narrower than the KV
        cache's (prompt KV is computed in the model's dtype, so the round trip is exact)."""
        if self.dtype.itemsize < self.kv_dtype.itemsize:
            return self.dtype
        return self.kv_dtype

    def prefix_cache_chunk_bytes(self) -> int:
        """Bytes one prefix-cache chunk (``CHUNK_TOKENS`` tokens' keys and values) takes."""
        a = self.args
        return 2 * a.n_layers * a.n_kv_heads * CHUNK_TOKENS * a.head_dim * self.prefix_cache_dtype.itemsize

    def configure_prefix_cache(self, capacity_bytes: int | None = None, *, shared: bool = False) -> None:
        """(Re)build the prefix cache, empty: ``capacity_bytes`` None sizes it to the machine
        (min(25% of RAM, 4 GiB)), 0 turns it off. A budget smaller than one full-context
        prompt's chunks raises ConfigError."""
        need = (self.max_context // CHUNK_TOKENS) * self.prefix_cache_chunk_bytes()
        if capacity_bytes is None:
            capacity_bytes = min(_ram_bytes() // 4, 4 << 30)
            if capacity_bytes < need:  # a small machine: no cache rather than a useless one
                capacity_bytes = 0
        elif isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ConfigError(f"prefix_cache_bytes must be an integer >= 0, got {capacity_bytes!r}")
        elif 0 < capacity_bytes < need:
            raise ConfigError(
                f"prefix_cache_bytes={capacity_bytes} is smaller than one request: a {self.max_context}-token "
                f"prompt's KV takes {need} bytes ({need / 2**20:.0f} MiB); give at least that, or 0 to turn "
                f"the prefix cache off")
        self.prefix_cache = PrefixCache(capacity_bytes, shared=shared) if capacity_bytes else None

    def _quantized_weights(self, weights: str | None, model, settings: Settings, dtype: torch.dtype) -> bool:
        """Whether a GGUF file's projections stay quantized (``cpu_quant.QuantLinear``) or are
        dequantized (the converted cache, then ``pack_linears``). ``weights`` (default
        ``$AGENTSPEC_WEIGHTS``, else "auto"): "quantized", "dense" or "auto" (quantized for a GGUF
        file other than the bundled model wherever the native quantized linears run: the bundled
        model's dense bfloat16 kernels, AMX paths and EAGLE-3 head are its tuned path)."""
        from pathlib import Path

        from ...kernels import cpu_quant

        mode = (weights if weights is not None else os.environ.get("AGENTSPEC_WEIGHTS", "auto")).strip().lower()
        if mode not in ("auto", "quantized", "dense"):
            raise ConfigError(f"weights={mode!r}: use auto, quantized or dense (AGENTSPEC_WEIGHTS)")
        if mode == "dense":
            return False
        gguf = model is not None and Path(model).suffix.lower() == ".gguf"
        why = None
        if not gguf:
            why = "the model is not a GGUF file" if model is not None else "the bundled model runs dense"
        elif self.device.type != "cpu":
            why = f"the quantized linears run on CPU, not {self.device.type}"
        elif not cpu_quant.linear_q_supported():
            why = "agentspec.kernels._cpu is not built with the quantized linears (re-run scripts/setup.sh)"
        elif not settings.native_linears:
            why = "AGENTSPEC_CPU_LINEAR=0 turns the native linears off"
        elif dtype != torch.bfloat16:
            why = f"the quantized linears take bfloat16 activations, not {str(dtype).removeprefix('torch.')}"
        elif mode == "auto" and _same_file(str(model), bundled_model_path):
            why = "the bundled model runs dense"
        if why is not None and mode == "quantized":
            raise ConfigError(f"weights='quantized' cannot run here: {why}; use weights='dense'")
        return why is None

    def _keep_weight_copy(self) -> bool:
        """Whether the native linears' packed copy goes beside the torch weights (2 copies) or
        replaces them (1 copy; prompt chunks off the AMX path then unpack a projection per
        forward). AGENTSPEC_WEIGHT_COPIES: "2", "1" or "auto" (the default: 1 where the packed
        copy would take more than half the memory still available)."""
        mode = _weight_copies_setting()
        if mode != "auto":
            return mode == "2"
        need, avail = self.model.linear_weight_bytes(), _available_bytes()
        if need <= avail // 2:
            return True
        if not self.quiet:
            print(f"[agentspec] one copy of the weights: packing them for decoding needs {need / 2**30:.1f} GiB "
                  f"and {avail / 2**30:.1f} GiB is available, so prompts unpack one projection at a time "
                  "(AGENTSPEC_WEIGHT_COPIES=2 keeps both)", file=sys.stderr, flush=True)
        return False

    @property
    def plan(self) -> KernelPlan:
        """The kernel plan at the ISA level the kernels run at now (``plan.KernelPlan``)."""
        return self.model.plan()

    def hardware_summary(self) -> str:
        """One line: CPU, threads and the kernel plan (the "model ready" line)."""
        if self.device.type != "cpu":
            return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else str(self.device)
        info = _cpu_isa.machine_info()
        gov = "adaptive" if self.governor.enabled else "fixed"
        return f"{info['cpu']}, {self.governor.max_threads} threads ({gov}); {self.plan.describe()}"

    def kernel_info(self) -> dict:
        """What ran, for benchmark JSON: CPU model and flags, usable cores, threads, dtype, the kernel plan."""
        info = _cpu_isa.machine_info() if self.device.type == "cpu" else {"device": str(self.device)}
        return {**info, "threads": self.governor.max_threads, "thread_governor": self.governor.enabled,
                "dtype": str(self.dtype).removeprefix("torch."),
                "kv_dtype": str(self.kv_dtype).removeprefix("torch."), "kernel_plan": self.plan.to_dict(),
                "weights": self.weight_types()}

    def weight_types(self) -> dict:
        """The projections' weight types and bytes: {"quantized": bool, "types": {type: GGUF tensors},
        "bytes": n} (a dense model: its dtype)."""
        m = self.model
        if not m.quantized:
            return {"quantized": False, "types": {str(self.dtype).removeprefix("torch."): 4 * self.args.n_layers + 1},
                    "bytes": m.linear_weight_bytes()}
        types: dict[str, int] = {}
        for lin in [x for layer in m.layers for x in layer.packed] + [m.head_packed]:
            for t in lin.types():
                types[t] = types.get(t, 0) + 1
        return {"quantized": True, "types": dict(sorted(types.items())), "bytes": m.linear_weight_bytes()}

    def new_cache(self, capacity: int) -> KVCache:
        """A KV cache for this engine's model (packed for the native attention where it runs)."""
        return KVCache(self.args, capacity, dtype=self.kv_dtype, device=self.device, packed=self.plan.kv_packed)

    # ------------------------------------------------------------------------------------------
    # prompts

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def encode(self, prompt: str | Sequence[int] | Sequence[dict]) -> list[int]:
        """Token ids for a prompt: text and messages get the chat template; ids are used as given
        (``check`` checks them with the rest of the request)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            return self.tokenizer.encode(self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
        if isinstance(prompt, (bytes, bytearray)):
            raise InvalidRequestError("prompt must be str, a list of token ids or a list of messages, got bytes",
                                      param="prompt")
        try:
            items = list(prompt)
        except TypeError:
            raise InvalidRequestError(
                f"prompt must be str, a list of token ids or a list of messages, got {type(prompt).__name__}",
                param="prompt") from None
        if not items:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(m, dict) for m in items):
            for i, m in enumerate(items):
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise InvalidRequestError(f"messages[{i}] needs string 'role' and 'content', got {m!r}",
                                              param="prompt")
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(items))
        return items   # token ids: checked with the rest of the request (``check``)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    # ------------------------------------------------------------------------------------------
    # grammars

    @property
    def constraints(self) -> Any:
        """The grammar compiler for this model (``agentspec.decode.constraint.ConstraintFactory``:
        the llguidance tokenizer, built once on the first grammar, over the logits' width)."""
        if self._constraints is None:
            from ...decode.constraint import ConstraintFactory

            with self._named_lock:
                if self._constraints is None:
                    self._constraints = ConstraintFactory(self.tokenizer, vocab=self.vocab_size)
        return self._constraints

    def constraint_for(self, grammar: str) -> Any:
        """A new ``Constraint`` (one request's grammar state) for ``grammar``; a grammar llguidance
        refuses raises InvalidRequestError (param "grammar") with its reason."""
        return self.constraints.compile(grammar)

    # ------------------------------------------------------------------------------------------
    # generation

    def generate(self, prompt: str | Sequence[int] | Sequence[dict], *, max_tokens: int = 256,
                 temperature: float = 0.0, spec: SpecConfig | None = DEFAULT_SPEC,
                 **options: Unpack[GenerateOptions]) -> Generation:
        """Generate up to ``max_tokens`` tokens. ``spec=None`` is plain decoding;
        ``spec.drafters`` names the drafters (e.g. ``SpecConfig(drafters=["suffix", "eagle3"])``;
        ``request_drafter``). ``options``: ``top_p``, ``top_k``, ``seed``, ``stop``, ``drafter``,
        ``tenant`` (``GenerateOptions``; as ``generate_stream``). A seeded sampled request's tokens
        are a function of the prompt and the seed alone: the same with or without speculation,
        whatever drafted for it."""
        unknown = sorted(set(options) - set(GenerateOptions.__annotations__))
        if unknown:
            raise TypeError(f"generate() got unexpected keyword argument(s) {', '.join(map(repr, unknown))} "
                            f"(options: {', '.join(GenerateOptions.__annotations__)})")
        stream = self.generate_stream(prompt, max_tokens=max_tokens, temperature=temperature, spec=spec, **options)
        while True:
            try:
                next(stream)
            except StopIteration as done:
                return done.value

    def generate_stream(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        spec: SpecConfig | None = DEFAULT_SPEC,
        drafter: Drafter | None = None,
        tenant: str = "default",
        should_stop: Callable[[], bool] | None = None,
        grammar: str | None = None,
        output: OutputFormat | None = None,
    ) -> Iterator[list[int]]:
        """Yield the newly committed token ids after every step; return the ``Generation``.

        Validation happens here, before the first ``next()``: bad input raises at once (a
        grammar is compiled here too). ``should_stop`` is called before every step; when it
        returns True the generation ends with finish_reason "cancelled" (a server uses it for
        disconnects and timeouts). ``grammar``: an llguidance grammar the output follows
        (``GenerationRequest.grammar``). ``output``: how the output reads (``GenerationRequest.output``:
        a tool-call format and its tools, or a JSON answer), for drafters that draft from it.
        """
        request = self.check(self.encode(prompt), max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k, seed=seed, stop=stop, spec=spec, tenant=tenant, grammar=grammar,
                             output=output)
        constraint = None if request.grammar is None else self.constraint_for(request.grammar)
        return self._run(request, drafter=self.request_drafter(drafter, spec), should_stop=should_stop,
                         constraint=constraint)

    # ------------------------------------------------------------------------------------------
    # drafters named by a request

    def request_drafter(self, drafter: Drafter | None, spec: SpecConfig | None) -> Drafter:
        """The drafter one request drafts with: ``drafter`` when given (an explicit drafter
        wins), else what ``spec.drafters`` names (``drafter_for``), else the engine's own. Called
        when the request is submitted, so a draft head that cannot be loaded fails the call, not
        a step."""
        if drafter is not None:
            return drafter
        if spec is not None and spec.drafters is not None:
            return self.drafter_for(spec.drafters)
        return self.drafter

    def _load_draft_model(self, path: str | os.PathLike, *, device: str, quiet: bool) -> EmbeddedEngine:
        """The draft model beside the target (``draft_model``): a smaller model of the same family,
        on the same kernels, its own prefix cache off; refused (ConfigError naming the file) when
        its tokenizer is not the target's (its token ids would mean other text)."""
        if not Path(path).is_file() and not Path(path).is_dir():
            raise ConfigError(f"draft model {str(path)!r} does not exist (a smaller GGUF file of the target's "
                              "family, e.g. Qwen2.5-Coder-0.5B for the 1.5B)")
        draft = EmbeddedEngine(model=str(path), device=device, kv_dtype=self.kv_dtype, quiet=True,
                               max_context=self.max_context, prefix_cache_bytes=0, row_cost=0.0)
        if draft.tokenizer.backend.get_vocab() != self.tokenizer.backend.get_vocab():
            raise ConfigError(f"draft model {str(path)!r} has another tokenizer than the target "
                              f"{str(self.model_path)!r}: a draft model must share the target's vocabulary "
                              "(the same family, e.g. Qwen2.5-Coder-0.5B for the 1.5B)")
        if not quiet:
            print(f"[agentspec] draft model {draft.model_path} ({draft.args.n_layers} layers, "
                  f"dim {draft.args.dim}) drafting for {self.model_path}", file=sys.stderr, flush=True)
        return draft

    @property
    def default_drafters(self) -> tuple[str, ...]:
        """What a request drafts with when nothing names its drafters: the suffix index and
        escape-aware copying, and the draft model behind them where one is loaded."""
        from ...drafting.registry import DEFAULT_DRAFTERS

        return (*DEFAULT_DRAFTERS, "draft_model") if self.draft_engine is not None else DEFAULT_DRAFTERS

    def drafter_for(self, names: Sequence[str] | str, *, index: Any = None) -> Drafter:
        """The drafter a list of drafter names builds (``agentspec.drafting.registry``:
        ``build_drafter``), built once per list (and index) for this engine and reused: drafters
        keep per-request state by request id, and a draft head is loaded (and checked against
        this model) once. Drafters that use a suffix index draft from ``index``, by default the
        engine's own drafter's (a workspace's, or the default suffix drafter's), so a tenant's
        history and workspace serve these requests as they serve the default ones (a server's
        backend passes its shared index). Unknown names raise ``ConfigError``; a head that is
        missing or does not fit the model ``ModelLoadError``."""
        from ...drafting.registry import build_drafter

        if index is None:
            index = getattr(self.drafter, "index", None)
        key = (names,) if isinstance(names, str) else tuple(names)
        d = self._named_drafters.get((key, id(index)))
        if d is not None:
            return d
        key = check_drafters(key)   # ConfigError naming a bad name and listing the known ones
        with self._named_lock:   # one build per list, even when two threads submit it at once
            d = self._named_drafters.get((key, id(index)))
            if d is None:
                d = build_drafter(key, index=index, engine=self)
                self._named_drafters[(key, id(index))] = d
        return d

    def check(self, ids: Sequence[int], *, max_tokens: Any, temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0,
              seed: Any = None, stop: Any = None, spec: Any = DEFAULT_SPEC, tenant: str = "default",
              grammar: Any = None, output: Any = None) -> GenerationRequest:
        """The engine API's arguments as a checked ``GenerationRequest`` (``check_request``, the
        one check every backend runs: InvalidRequestError / ContextLengthError naming the bad
        value)."""
        try:
            request = GenerationRequest(prompt_ids=ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                        top_k=top_k, seed=seed, stop=[stop] if isinstance(stop, str) else stop or [],
                                        spec=spec, tenant=tenant, grammar=grammar, output=output)
        except TypeError as e:   # a value msgspec.Struct cannot take (not type-checked at construction)
            raise InvalidRequestError(str(e), param="request") from None
        return check_request(request, vocab_size=self.vocab_size, max_context=self.max_context)

    def _run(self, request: GenerationRequest, *, drafter: Drafter | None,
             should_stop: Callable[[], bool] | None = None, constraint: Any = None) -> Iterator[list[int]]:
        seq = self.decoder.sequence(request, drafter=drafter, off_reason=self.spec_off_reason, constraint=constraint)
        with self._lock:
            need = self.decoder.cache_need(seq)
            seq.cache = self._ensure_cache(need)
            seq.cache.reset()
            if seq.width:  # fixed key length for deterministic mode: a function of the request alone
                seq.key_len = min(round_up(need, 256), seq.cache.capacity)
            return (yield from run_single(self.decoder, seq, should_stop))

    def _ensure_cache(self, need: int) -> KVCache:
        if self._cache is None or self._cache.capacity < need:
            cap = min(round_up(max(need, 1024), 1024), round_up(self.max_context + 1024, 256))
            self._cache = None
            self._cache = self.new_cache(max(cap, need))
        return self._cache


def _repack(ckpt, quiet: bool) -> dict:
    """Every quantized projection of ``ckpt`` repacked for the native kernel (``QuantLinear``),
    with a progress bar (a few seconds for a 1.5B model)."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    from ...kernels.cpu_quant import QuantLinear

    a = ckpt.args
    out = {}
    def one(item):
        name, parts = item
        try:
            lin = QuantLinear.from_raw(parts)
        except ValueError as e:   # an unsupported type (named), or rows that are not whole blocks
            raise ModelLoadError(f"{ckpt.source}: {name}: {e}") from None
        ckpt.release(parts)   # the file's pages of these tensors: not resident twice
        return name, lin

    # numpy releases the GIL in the unpacking and interleaving: one worker per usable core
    total = 4 * a.n_layers + 1 + (not a.tie_embeddings)
    with ThreadPoolExecutor(max_workers=_cpu_isa.usable_cpus()) as pool, \
            tqdm(total=total, desc="repacking quantized weights", unit="tensor", disable=quiet, file=sys.stderr) as bar:
        for name, lin in pool.map(one, ckpt.projections()):
            out[name] = lin
            bar.update()
    return out


def _same_file(path: str, other) -> bool:
    """Whether ``path`` is the file ``other()`` names (False when ``other`` has none)."""
    from pathlib import Path

    try:
        return Path(path).resolve() == Path(other()).resolve()
    except Exception:  # noqa: BLE001 - the bundled model is not installed
        return False


def _weight_copies_setting() -> str:
    mode = os.environ.get("AGENTSPEC_WEIGHT_COPIES", "auto").strip().lower()
    if mode not in ("auto", "1", "2"):
        raise ConfigError(f"AGENTSPEC_WEIGHT_COPIES={mode!r}: use 1, 2 or auto")
    return mode


def _available_bytes() -> int:
    """Memory this process can still take: MemAvailable, or the cgroup's headroom when lower."""
    avail = _ram_bytes()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for limit_path, used_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                   "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(used_path) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit():
            avail = min(avail, int(limit) - used)
    return avail


def _ram_bytes() -> int:
    """Physical memory (the cgroup's limit when lower)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 << 30
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            ram = min(ram, int(limit))
    return ram


def _dtype(value, name: str) -> torch.dtype:
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if isinstance(value, torch.dtype) and value in names.values():
        return value
    if isinstance(value, str) and value in names:
        return names[value]
    raise ConfigError(f"{name} must be float32, bfloat16 or float16, got {value!r}")


def cpu_has_fast_bf16() -> bool:
    """True when this CPU has bfloat16 dot-product instructions (AVX512-BF16, AMX or Arm BF16)."""
    return _cpu_isa.has_bf16_instructions()


