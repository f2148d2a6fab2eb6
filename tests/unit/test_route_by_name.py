"""A request's ``route`` picks a configured route by name (an editor's ``agentspec.route``)."""

from __future__ import annotations

import pytest

from agentspec.api.routing import Router, UnknownRouteError
from agentspec.config import RouteRule, RouteWhen

RULES = [
    RouteRule(name="hot", when=RouteWhen(min_temperature=0.5), speculation=False),
    RouteRule(name="acme-only", when=RouteWhen(tenant="acme"), budget=8),
    RouteRule(name="completions", when=RouteWhen(endpoint="completions"), budget=4),
]


def resolve(router: Router, **kw):
    args = {"endpoint": "apply", "tenant": "beta", "model": "m", "temperature": 0.0, **kw}
    return router.resolve(**args)


def test_a_named_route_decides_whatever_its_when_says_of_endpoint_and_temperature():
    router = Router(RULES)
    assert resolve(router).name == "default"                     # no rule matches by `when`
    r = resolve(router, name="completions")
    assert (r.name, r.spec.budget) == ("completions", 4)
    assert resolve(router, name="hot").spec is None             # at temperature 0 too
    assert resolve(router, name="default").name == "default"
    assert resolve(router, temperature=1.0, name=None).name == "hot"


def test_a_named_route_keeps_its_tenant_restriction_and_lists_what_the_tenant_has():
    router = Router(RULES)
    assert resolve(router, tenant="acme", name="acme-only").spec.budget == 8
    with pytest.raises(UnknownRouteError) as info:
        resolve(router, tenant="beta", name="acme-only")
    msg = str(info.value)
    assert "'acme-only'" in msg and "'beta'" in msg
    assert "hot, completions, default" in msg and "acme-only, " not in msg
    with pytest.raises(UnknownRouteError, match="route 'nosuch' is not configured"):
        Router([]).resolve(endpoint="apply", tenant="default", model="m", temperature=0.0, name="nosuch")
