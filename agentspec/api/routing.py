"""Per-route rules: which speculation one request gets.

Rules are evaluated per request, in the order the config lists them; the first whose ``when``
matches decides. No match: route "default", speculation on with ``SpecConfig()``'s defaults.
A request may name its route instead (``route``, e.g. an editor's setting): that rule decides,
whatever its ``when`` says of the endpoint, model and temperature, as long as its ``when.tenant``
takes the request's tenant; "default" is the built-in route.
Speculation is then still subject to what the engine can do exactly (sampled requests are
verified greedily nowhere; the engine records why it turned speculation off).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from ..config import RouteRule, SpecConfig

__all__ = ["Route", "Router", "UnknownRouteError"]


class UnknownRouteError(ValueError):
    """A request named a route that is not configured for its tenant (the message lists those that are)."""


class Route(msgspec.Struct, frozen=True, kw_only=True):
    name: str                   # the matched rule, or "default"
    spec: SpecConfig | None     # None: speculation off
    reason: str                 # why speculation is off ("" when on)
    # which drafters propose (agentspec.drafting.registry.build_drafter; e.g. ("suffix", "eagle3"): the
    # suffix index backed by the EAGLE-3 head); None: the rule names none, so the backend's default
    drafters: tuple[str, ...] | None = None


def _matches(value, want) -> bool:
    if want is None:
        return True
    return value in ([want] if isinstance(want, str) else want)


_DEFAULT = Route(name="default", spec=SpecConfig(), reason="")


class Router:
    def __init__(self, rules: Sequence[RouteRule] = ()) -> None:
        self.rules = list(rules)

    def configured(self) -> list[Route]:
        """Every rule's route, in config order (a server builds their drafters at start-up, so a
        route naming a draft head that is missing or does not fit the model refuses to start)."""
        return [self._route(rule) for rule in self.rules]

    def resolve(self, *, endpoint: str, tenant: str, model: str, temperature: float, name: str | None = None) -> Route:
        """The route of one request: the rule called ``name`` when given (UnknownRouteError if the
        tenant has none of that name), else the first rule whose ``when`` matches."""
        if name is not None:
            return self.named(name, tenant=tenant)
        for rule in self.rules:
            w = rule.when
            if not (_matches(endpoint, w.endpoint) and _matches(tenant, w.tenant) and _matches(model, w.model)):
                continue
            if w.min_temperature is not None and temperature < w.min_temperature:
                continue
            if w.max_temperature is not None and temperature > w.max_temperature:
                continue
            return self._route(rule)
        return _DEFAULT

    def named(self, name: str, *, tenant: str) -> Route:
        usable = [rule for rule in self.rules if _matches(tenant, rule.when.tenant)]
        for rule in usable:
            if rule.name == name:
                return self._route(rule)
        if name == "default" and "default" not in {r.name for r in self.rules}:
            return _DEFAULT
        names = [r.name for r in usable] + (["default"] if "default" not in {r.name for r in self.rules} else [])
        raise UnknownRouteError(f"route {name!r} is not configured for tenant {tenant!r}; its routes: "
                                f"{', '.join(names)} (the server config's [[routes]] names)")

    @staticmethod
    def _route(rule: RouteRule) -> Route:
        drafters = tuple(rule.drafters) if rule.drafters else None
        if not rule.speculation:
            return Route(name=rule.name, spec=None, reason=f"route {rule.name!r}: speculation = false",
                         drafters=drafters)
        spec = SpecConfig(forced_drafts=rule.forced_drafts, **({} if rule.budget is None else {"budget": rule.budget}))
        if spec.budget == 0:
            return Route(name=rule.name, spec=None, reason=f"route {rule.name!r}: budget = 0", drafters=drafters)
        return Route(name=rule.name, spec=spec, reason="", drafters=drafters)
