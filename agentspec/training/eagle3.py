"""Training an EAGLE-3 head for an embedded-engine target (``agentspec train-eagle3``).

Pipeline (``docs/eagle3-format.md`` section 6, SpecForge's recipe on our engine):

1. **data**: self-distilled records (``training.distill``): the target's own responses;
2. **features**: each record (its last ``max_len`` tokens) is run teacher-forced through the
   target, keeping the feature layers' outputs (low, mid, high; ``[T, 3H]``) and the target's
   greedy token at every position (its argmax: what the head must predict);
3. **vocabulary**: the ``draft_vocab_size`` most frequent target tokens of the loss positions
   (``build_vocab_map``: ``d2t`` / ``t2d``);
4. **training-time test**: ``ttt_steps`` unrolled steps per position; step ``k`` feeds the head
   its own previous output and the token ``k + 1`` ahead (at RoPE position ``t + k``, attending
   to the context's step-0 keys up to ``t`` and its own earlier steps' keys at ``t``), loss
   weights ``decay ** k``; cross-entropy to the target's greedy token over the draft vocabulary
   (positions whose token is outside it are masked). Response positions weigh 1, prompt
   positions ``prompt_weight``; AdamW, warm-up then cosine decay, gradient clipping;
5. **checkpoints**: ``<out>/train-state.pt`` every ``checkpoint_every`` optimiser steps (resume
   continues from it: same data order, same RNG); the head is written with ``save_eagle3``
   (SGLang's layout) at the end.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from suffix_index.atomic import open_atomic

from ..drafting.eagle3 import Eagle3Config, Eagle3Head, build_vocab_map, save_eagle3
from ..kernels.rope import apply_rope

__all__ = ["Sample", "TrainConfig", "extract_features", "train_head", "ttt_loss"]


@dataclass
class TrainConfig:
    draft_vocab_size: int = 8192
    ttt_steps: int = 7
    decay: float = 0.8
    lr: float = 6e-4
    min_lr_ratio: float = 0.05
    warmup: float = 0.03
    epochs: float = 4.0
    batch_rows: int = 8192          # loss rows per optimiser step (records accumulate up to it)
    max_len: int = 1024             # tokens per record window (its last max_len)
    prompt_weight: float = 0.2
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    seed: int = 0
    checkpoint_every: int = 100
    feature_layers: tuple[int, ...] | None = None


@dataclass
class Sample:
    tokens: torch.Tensor     # [T] int64 (the window)
    feats: torch.Tensor      # [T, 3H] (target feature layers, low..high)
    labels: torch.Tensor     # [T] int64: the target's greedy token after each position
    weights: torch.Tensor    # [T] float: loss weight of the label at each position


def _log(msg: str) -> None:
    print(f"[train-eagle3] {msg}", file=sys.stderr, flush=True)


@torch.inference_mode()
def extract_features(engine, records: list[dict], *, feature_layers, max_len: int, prompt_weight: float,
                     store: str | torch.device = "cpu", progress: bool = True) -> list[Sample]:
    """Teacher-forced target forwards over ``records`` (``prompt_ids`` + ``response_ids``)."""
    from .distill import _Progress

    model, dev = engine.model, engine.device
    layers = tuple(int(i) for i in feature_layers)
    out: list[Sample] = []
    bar = _Progress(len(records), 0, enabled=progress, desc="features")
    t0, n_tok = time.perf_counter(), 0
    for rec in records:
        ids = list(rec["prompt_ids"]) + list(rec["response_ids"])
        resp_start = len(rec["prompt_ids"])
        if len(ids) > max_len:
            cut = len(ids) - max_len
            ids, resp_start = ids[cut:], max(resp_start - cut, 0)
        T = len(ids)
        if T < 3:
            continue
        cache = engine.new_cache(T + 1)
        tok = torch.tensor(ids, device=dev)
        last = len(model.layers) - 1
        _, hidden = model(tok, torch.arange(T, device=dev), cache, logits_rows=slice(0, 1),
                          hidden_layers=tuple(sorted(set(layers) | {last})))
        # the target's greedy token at every row, from the last layer's output (in chunks: the
        # whole [T, V] float32 logits at once is large on a CPU)
        labels = torch.cat([model._logits(hidden[last][c:c + 512]).argmax(-1) for c in range(0, T, 512)])
        labels = labels.to(torch.int64)
        feats = torch.cat([hidden[i] for i in layers], dim=-1)
        w = torch.full((T,), float(prompt_weight))
        # label at position t predicts token t + 1: a response token iff t + 1 >= resp_start
        w[max(resp_start - 1, 0):] = 1.0
        out.append(Sample(tokens=tok.to(store), feats=feats.to(store, torch.bfloat16), labels=labels.to(store),
                          weights=w.to(store)))
        n_tok += T
        bar.update(1, n_tok / max(time.perf_counter() - t0, 1e-9))
    bar.close()
    return out


# --------------------------------------------------------------------------------------------
# training-time test
# --------------------------------------------------------------------------------------------

def _attn_ttt(head: Eagle3Head, u: torch.Tensor, pos: torch.Tensor, k0, v0, extra: list, n: int):
    """Attention of step rows ``u [n, 2H]`` at positions ``pos``: causal over the step-0 keys
    (``k0``/``v0`` ``[Hkv, n0, hd]``; None at step 0, then this step's own keys are the step-0
    keys) plus, per row, the keys of steps 1..k at that row (``extra``). Returns (out, k, v)."""
    a = head.midlayer.self_attn
    hd, nh, nkv = a.head_dim, a.n_heads, a.n_kv
    G = nh // nkv
    cos, sin = head._rope(pos)
    q = apply_rope(a.q_proj(u).view(n, nh, hd).transpose(0, 1).float(), cos, sin)
    k = apply_rope(a.k_proj(u).view(n, nkv, hd).transpose(0, 1).float(), cos, sin)
    v = a.v_proj(u).view(n, nkv, hd).transpose(0, 1).float()
    scale = 1.0 / math.sqrt(hd)
    K0, V0 = (k, v) if k0 is None else (k0[:, :n], v0[:, :n])
    K0r, V0r = K0.repeat_interleave(G, 0), V0.repeat_interleave(G, 0)
    s0 = torch.matmul(q, K0r.transpose(1, 2)) * scale                         # [nh, n, n]
    causal = torch.ones(n, n, dtype=torch.bool, device=u.device).tril()
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag_k = [kk[:, :n] for kk, _ in extra] + ([k] if k0 is not None else [])
    diag_v = [vv[:, :n] for _, vv in extra] + ([v] if k0 is not None else [])
    if diag_k:
        sd = torch.stack([(q * kk.repeat_interleave(G, 0)).sum(-1) for kk in diag_k], dim=-1) * scale  # [nh, n, j]
        p = torch.softmax(torch.cat([s0, sd], dim=-1), dim=-1)
        out = torch.matmul(p[..., :n], V0r)
        for j, vv in enumerate(diag_v):
            out = out + p[..., n + j:n + j + 1] * vv.repeat_interleave(G, 0)
    else:
        out = torch.matmul(torch.softmax(s0, dim=-1), V0r)
    out = out.transpose(0, 1).reshape(n, nh * hd).to(u.dtype)
    return a.o_proj(out), k, v


def ttt_loss(head: Eagle3Head, embed: torch.Tensor, s: Sample, t2d_index: torch.Tensor, *, steps: int,
             decay: float) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The training-time-test loss of one sample: (weighted loss sum, weight sum at step 0,
    per-step accuracy numerators, per-step weight sums; 0-d tensors). ``t2d_index``: target id ->
    draft id or -1."""
    m = head.midlayer
    T = s.tokens.shape[0]
    dt = head.fc.weight.dtype
    h = head.fc(s.feats[:T - 1].to(dt))
    k0 = v0 = None
    extra: list = []
    total = torch.zeros((), device=h.device)
    w0 = torch.zeros(())
    accs: list[torch.Tensor] = []
    wsum: list[torch.Tensor] = []
    for k in range(steps):
        n = T - 1 - k
        if n <= 0:
            break
        hid = h[:n]
        emb = embed[s.tokens[1 + k:1 + k + n]].to(dt)
        u = torch.cat([m.input_layernorm(emb), m.hidden_norm(hid)], dim=-1)
        pos = torch.arange(k, k + n, device=h.device)
        a_out, kk, vv = _attn_ttt(head, u, pos, k0, v0, extra, n)
        if k == 0:
            k0, v0 = kk, vv
        else:
            extra.append((kk, vv))
        h1 = hid + a_out
        h2 = h1 + m.mlp(m.post_attention_layernorm(h1))
        logits = head.lm_head(head.norm(h2)).float()
        lab = t2d_index[s.labels[1 + k:1 + k + n]]
        w = s.weights[1 + k:1 + k + n] * (lab >= 0)
        ce = F.cross_entropy(logits, lab.clamp(min=0), reduction="none")
        total = total + (decay ** k) * (ce * w).sum()
        with torch.no_grad():
            # tensors, not floats: a host sync per step would stall a GPU (read when logging)
            accs.append(((logits.argmax(-1) == lab).float() * w).sum())
            wsum.append(w.sum())
        if k == 0:
            w0 = w.sum()
        h = h2
    return total, w0, accs, wsum


def _lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    warm = max(int(total * cfg.warmup), 1)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    p = min((step - warm) / max(total - warm, 1), 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def train_head(engine, samples: list[Sample], out: str | os.PathLike, cfg: TrainConfig, *,
               work: str | os.PathLike | None = None, eval_samples: list[Sample] | None = None,
               device: str | torch.device | None = None, progress: bool = True, resume: bool = True,
               time_limit: float | None = None, init: str | os.PathLike | None = None) -> dict[str, Any]:
    """Train a head on ``samples``; write it to ``out`` (SGLang layout; replaced atomically).
    ``work``: folder for the resumable state (default ``out`` + ``.work``); ``init``: start from
    this head (its config and vocabulary map) instead of from scratch. Returns a summary."""
    out = Path(out)
    work = Path(work) if work is not None else out.with_name(out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    dev = torch.device(device) if device is not None else engine.device
    torch.manual_seed(cfg.seed)
    args = engine.args
    tok = engine.tokenizer
    eos = min(tok.eos_token_ids) if getattr(tok, "eos_token_ids", None) else None
    counts = torch.zeros(args.vocab_size, dtype=torch.float64)
    for s in samples:
        counts.index_add_(0, s.labels.cpu(), s.weights.cpu().double())
    if init is not None:
        from ..drafting.eagle3 import load_eagle3

        head, config = load_eagle3(init, target_args=args, dtype=torch.float32)
        if config.draft_vocab_size != cfg.draft_vocab_size:
            raise ValueError(f"--init head has draft_vocab_size {config.draft_vocab_size}, not {cfg.draft_vocab_size}")
        t2d = head.t2d.clone()
        head.train()
    else:
        config = Eagle3Config.for_target(args, draft_vocab_size=cfg.draft_vocab_size, layers=cfg.feature_layers,
                                         eos_token_id=eos)
        # the draft vocabulary: the most frequent target tokens where the loss is
        d2t, t2d = build_vocab_map(counts, cfg.draft_vocab_size)
        head = Eagle3Head(config)
        head.set_vocab_map(d2t, t2d)
    coverage = float(counts[t2d].sum() / counts.sum().clamp(min=1e-9))
    head.to(dev)
    t2d_index = torch.full((args.vocab_size,), -1, dtype=torch.int64)
    t2d_index[t2d] = torch.arange(cfg.draft_vocab_size)
    t2d_index = t2d_index.to(dev)
    embed = engine.model.embed.weight.detach().to(dev, torch.float32)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    rows_per_epoch = sum(s.tokens.shape[0] - 1 for s in samples)
    total_steps = max(int(cfg.epochs * rows_per_epoch / cfg.batch_rows), 1)
    state_file = work / "train-state.pt"
    step, epoch, pos = 0, 0, 0
    history: list[dict] = []
    if resume and state_file.exists():
        st = torch.load(state_file, map_location=dev, weights_only=False)
        if st.get("config") != asdict(cfg) or st.get("n_samples") != len(samples):
            raise ValueError(f"{state_file} was written with other settings or data; remove it to start afresh")
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        step, epoch, pos, history = st["step"], st["epoch"], st["pos"], st["history"]
        _log(f"resumed at step {step}/{total_steps} from {state_file}")
    use_amp = dev.type == "cuda"
    from tqdm import tqdm

    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", file=sys.stderr) if progress else None
    t_start = time.perf_counter()
    head.train()

    def order_for(ep: int) -> list[int]:
        o = list(range(len(samples)))
        random.Random(cfg.seed * 1000003 + ep).shuffle(o)
        return o

    order = order_for(epoch)
    acc_num = [0.0] * cfg.ttt_steps
    acc_den = [0.0] * cfg.ttt_steps
    loss_sum = 0.0
    while step < total_steps:
        if time_limit is not None and time.perf_counter() - t_start > time_limit:
            _log(f"time limit reached at step {step}")
            break
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, total_steps, cfg)
        opt.zero_grad(set_to_none=True)
        rows = 0.0
        while rows < cfg.batch_rows:
            if pos >= len(order):
                epoch, pos = epoch + 1, 0
                order = order_for(epoch)
            s = samples[order[pos]]
            pos += 1
            s = Sample(s.tokens.to(dev), s.feats.to(dev), s.labels.to(dev), s.weights.to(dev))
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=use_amp):
                loss, _, accs, ws = ttt_loss(head, embed, s, t2d_index, steps=cfg.ttt_steps, decay=cfg.decay)
            (loss / cfg.batch_rows).backward()
            rows += s.tokens.shape[0] - 1
            loss_sum += loss.detach()
            for i, (a, w) in enumerate(zip(accs, ws)):
                acc_num[i] += a
                acc_den[i] += w
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        if bar is not None:
            bar.update(1)
        if step % 20 == 0 or step == total_steps:
            acc = [round(float(a) / max(float(d), 1e-9), 3) for a, d in zip(acc_num, acc_den)]
            rec = {"step": step, "epoch": epoch, "lr": opt.param_groups[0]["lr"],
                   "loss": round(float(loss_sum) / max(float(acc_den[0]), 1e-9), 4), "acc": acc,
                   "seconds": round(time.perf_counter() - t_start, 1)}
            history.append(rec)
            msg = f"step {step}/{total_steps} epoch {epoch} loss {rec['loss']} acc@1..{len(acc)} {acc}"
            if bar is not None:
                bar.set_postfix_str(f"loss {rec['loss']} acc0 {acc[0]}")
            else:
                _log(msg)
            acc_num = [0.0] * cfg.ttt_steps
            acc_den = [0.0] * cfg.ttt_steps
            loss_sum = 0.0
        if step % cfg.checkpoint_every == 0 and step < total_steps:
            _save_state(state_file, head, opt, cfg, step, epoch, pos, history, len(samples))
    if bar is not None:
        bar.close()
    head.eval()
    summary: dict[str, Any] = {"steps": step, "total_steps": total_steps, "epochs": epoch,
                               "train_rows_per_epoch": rows_per_epoch, "draft_vocab_coverage": round(coverage, 4),
                               "seconds": round(time.perf_counter() - t_start, 1), "history": history[-5:],
                               "config": asdict(cfg)}
    if eval_samples:
        summary["eval"] = evaluate(head, embed, eval_samples, t2d_index, cfg, dev)
        _log(f"eval accuracy per TTT step: {summary['eval']}")
    save_eagle3(head, config, out)
    if step >= total_steps and state_file.exists():
        state_file.unlink()
    elif step < total_steps:
        _save_state(state_file, head, opt, cfg, step, epoch, pos, history, len(samples))
    return summary


@torch.no_grad()
def evaluate(head: Eagle3Head, embed, samples: list[Sample], t2d_index, cfg: TrainConfig, dev) -> list[float]:
    """Per-TTT-step accuracy (weighted) on held-out samples."""
    num = [0.0] * cfg.ttt_steps
    den = [0.0] * cfg.ttt_steps
    head.eval()
    for s in samples:
        s = Sample(s.tokens.to(dev), s.feats.to(dev), s.labels.to(dev), s.weights.to(dev))
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            _, _, accs, ws = ttt_loss(head, embed, s, t2d_index, steps=cfg.ttt_steps, decay=cfg.decay)
        for i, (a, w) in enumerate(zip(accs, ws)):
            num[i] += a
            den[i] += w
    return [round(float(a) / max(float(d), 1e-9), 4) for a, d in zip(num, den)]


def _save_state(path: Path, head, opt, cfg, step, epoch, pos, history, n_samples) -> None:
    with open_atomic(path) as f:   # a crash mid-save leaves the previous state to resume from
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "config": asdict(cfg), "step": step,
                    "epoch": epoch, "pos": pos, "history": history, "n_samples": n_samples}, f)
