"""``agentspec train-eagle3``: distil, extract features, train, write the head (SGLang layout)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def cmd_train_eagle3(args) -> int:
    from ..backends.embedded.engine import EmbeddedEngine
    from .distill import distill, load_prompt_items, read_distilled
    from .eagle3 import TrainConfig, extract_features, train_head

    if not args.data and not args.distilled:
        print("agentspec train-eagle3: give --data FILE... (prompts) and/or --distilled FILE...", file=sys.stderr)
        return 2
    for f in [*args.data, *args.distilled]:
        if not Path(f).is_file():
            print(f"agentspec train-eagle3: no such file {f!r}", file=sys.stderr)
            return 2
    out = Path(args.out)
    work = Path(args.work) if args.work else out.with_name(out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    # training reads the target only; the drafter is used when distilling (--data)
    from ..drafting import PromptLookupDrafter

    engine = EmbeddedEngine(model=args.target, device=args.device, row_cost=0.05,
                            drafter=None if args.data else PromptLookupDrafter())
    records: list[dict] = []
    if args.data:
        items = load_prompt_items(args.data, engine.tokenizer, max_prompt=args.max_prompt, skip=args.skip)
        print(f"[train-eagle3] {len(items)} prompts; distilling the target's responses into {work / 'distilled.jsonl'}",
              file=sys.stderr, flush=True)
        distill(engine, items, work / "distilled.jsonl", max_tokens=args.max_tokens, samples=args.samples,
                temperature=args.temperature, seed=args.seed, concurrency=args.concurrency)
        # only this run's prompts: a record left from an earlier run with other --data or --skip
        # may be a prompt that is now held out
        want = {it.id for it in items}
        records += [r for r in read_distilled(work / "distilled.jsonl") if r["id"] in want]
    for f in args.distilled:
        records += read_distilled(f)
    records = [r for r in records if r.get("response_ids")]
    if len(records) < 2:
        print("agentspec train-eagle3: fewer than 2 records with a response to train on", file=sys.stderr)
        return 2
    cfg = TrainConfig(draft_vocab_size=args.draft_vocab, epochs=args.epochs, max_len=args.max_len,
                      ttt_steps=args.ttt_steps, lr=args.lr, batch_rows=args.batch_rows, seed=args.seed)
    # held-out evaluation: whole conversations (records sharing the id before '#': later turns
    # repeat earlier ones' history), chosen by the seed once and kept in the work folder, so a
    # rerun or a continued head (--init) is evaluated on what it never trained on
    from .distill import _group

    held_file = work / "heldout.json"
    if held_file.exists():
        held_groups = set(json.loads(held_file.read_text()))
    else:
        groups = sorted({_group(r["id"]) for r in records})
        random.Random(args.seed).shuffle(groups)
        held_groups = set(groups[:int(len(groups) * args.eval_fraction)])
        held_file.write_text(json.dumps(sorted(held_groups)))
    train = [r for r in records if _group(r["id"]) not in held_groups]
    held_r = [r for r in records if _group(r["id"]) in held_groups]
    from ..drafting.eagle3 import Eagle3Config, default_feature_layers

    fl = default_feature_layers(engine.args.n_layers)
    if args.init:   # a continued head reads the layers it was trained on
        init_cfg = Eagle3Config.from_json((Path(args.init) / "config.json").read_text())
        fl = init_cfg.feature_layers or fl
    print(f"[train-eagle3] features of layers {fl} for {len(train)} records (+{len(held_r)} held out) "
          f"on {engine.device}", file=sys.stderr, flush=True)
    # features stay on the device that trains (a GPU holds them all; on a CPU they are in RAM)
    samples = extract_features(engine, train, feature_layers=fl, max_len=cfg.max_len, prompt_weight=cfg.prompt_weight,
                               store=engine.device)
    evals = extract_features(engine, held_r, feature_layers=fl, max_len=cfg.max_len,
                             prompt_weight=cfg.prompt_weight, progress=False, store=engine.device) if held_r else None
    summary = train_head(engine, samples, out, cfg, work=work, eval_samples=evals, time_limit=args.time_limit,
                         init=args.init)
    summary["records"] = {"train": len(train), "held_out": len(held_r)}
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}))
    print(f"[train-eagle3] head written to {out}", file=sys.stderr)
    return 0
