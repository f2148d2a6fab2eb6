"""Importing agentspec's light parts loads neither torch nor the native kernels.

The config, the router, the drafting layer and the suffix index are used by processes that
never run the embedded engine (an SGLang worker, the CLI's config checks); each check runs in a
fresh interpreter, since this test process may have torch loaded already.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _heavy(mods: list[str]) -> list[str]:
    return [m for m in mods if m == "torch" or m.startswith(("torch.", "agentspec.kernels", "agentspec.backends.embedded"))]


def test_light_imports_load_no_torch_and_no_kernels():
    r = _run("""
        import json, sys
        import agentspec, suffix_index, agentspec.drafting, agentspec.config, agentspec.api.routing
        from agentspec import Draft, SpecConfig, ConfigError
        from agentspec.drafting import build_drafter, FallbackDrafter, HiddenStateDrafter
        from agentspec.drafting.draft import cut_for_cost
        d = build_drafter(["suffix>lookahead", "prompt_lookup"])
        d.start("r", [1, 2, 3, 1, 2])
        d.propose("r", 4)
        print(json.dumps({"mods": sorted(sys.modules)}))
    """)
    assert _heavy(r["mods"]) == []


def test_suffix_index_alone_and_the_draft_leaf():
    r = _run("""
        import json, sys
        import suffix_index
        s = suffix_index.SuffixIndex()
        s.start("r", [1, 2, 3, 1, 2])
        d = s.propose("r", 4)
        a = sorted(sys.modules)
        print(json.dumps({"mods": a, "type": type(d).__module__ + "." + type(d).__name__}))
    """)
    assert _heavy(r["mods"]) == []
    assert r["type"] == "suffix_index.index.Proposal"
    assert [m for m in r["mods"] if m.split(".")[0] == "agentspec"] == []   # standalone: nothing from agentspec
    r = _run("""
        import json, sys
        import suffix_index.atomic
        print(json.dumps({"mods": sorted(sys.modules)}))
    """)
    assert "numpy" not in r["mods"] and "suffix_index._core" not in r["mods"]   # the write helper alone is light
    r = _run("""
        import json, sys
        import agentspec.drafting.draft
        print(json.dumps({"mods": sorted(sys.modules)}))
    """)
    assert _heavy(r["mods"]) == [] and "numpy" not in r["mods"] and "suffix_index" not in r["mods"]


def test_public_names_resolve_lazily():
    r = _run("""
        import json, sys
        import agentspec
        before = "torch" in sys.modules
        names = {n: getattr(agentspec, n).__name__ for n in ("Draft", "Drafter", "SuffixDrafter", "PromptLookupDrafter",
                                                             "default_drafter", "SpecConfig")}
        mid = "torch" in sys.modules
        from agentspec import EmbeddedEngine, Engine, Generation, GenerationStats, Workspace
        print(json.dumps({"before": before, "mid": mid, "after": "torch" in sys.modules,
                          "engine": EmbeddedEngine.__module__, "all": sorted(agentspec.__all__),
                          "dir": all(n in dir(agentspec) for n in agentspec.__all__),
                          "missing": [n for n in agentspec.__all__ if not hasattr(agentspec, n)]}))
    """)
    assert r["before"] is False and r["mid"] is False
    assert r["after"] is True and r["engine"] == "agentspec.backends.embedded.engine"
    assert r["dir"] and r["missing"] == []


def test_unknown_attribute_raises():
    import agentspec
    import agentspec.drafting

    for mod in (agentspec, agentspec.drafting):
        try:
            mod.does_not_exist
        except AttributeError as e:
            assert "does_not_exist" in str(e)
        else:
            raise AssertionError("expected AttributeError")


def test_no_package_level_import_cycle():
    """The folders follow the request path (api -> backends -> decode -> drafting -> index): no
    two of agentspec's subpackages import each other at module level (imports inside functions
    and under TYPE_CHECKING excluded)."""
    import ast

    roots = {"agentspec": "agentspec", "kernels": "agentspec.kernels", "integrations": "agentspec.integrations"}

    def unit(mod: str) -> str:
        parts = mod.split(".")
        if len(parts) > 2 and parts[1] in ("kernels", "integrations"):
            return ".".join(parts[:3])
        return ".".join(parts[:2])

    graph: dict[str, set[str]] = {}
    for folder, pkg in roots.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("").parts
            mod = ".".join([pkg, *rel]).removesuffix(".__init__")
            base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ImportFrom):
                    target = (".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
                              if node.level else node.module or "")
                    targets = [target]
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                else:
                    continue
                for t in targets:
                    if t.startswith("agentspec.") and unit(t) != unit(mod):
                        graph.setdefault(unit(mod), set()).add(unit(t))

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            x = todo.pop()
            if x == b:
                return True
            if x not in seen:
                seen.add(x)
                todo.extend(graph.get(x, ()))
        return False

    cycles = sorted({tuple(sorted((a, b))) for a, outs in graph.items() for b in outs if reaches(b, a)})
    assert not cycles, f"subpackages that import each other: {cycles}"


def test_llguidance_loads_only_with_a_grammar():
    """The engine, the decode step and the request checks import no llguidance: only compiling a
    request's grammar (``EmbeddedEngine.constraint_for``) loads it."""
    r = _run("""
        import json, sys
        import agentspec
        import agentspec.backends.embedded.engine, agentspec.backends.embedded.backend
        import agentspec.decode.step, agentspec.decode.constraint
        from agentspec.backends.protocol import GenerationRequest, check_request
        check_request(GenerationRequest(prompt_ids=[1], max_tokens=1, grammar='start: "a"'), vocab_size=10,
                      max_context=10)
        print(json.dumps({"mods": sorted(sys.modules)}))
    """)
    assert "llguidance" not in r["mods"]
