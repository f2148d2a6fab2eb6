"""README.md's tour, run as written against a real `agentspec serve` of this repository with the
bundled model (helpers/tour.py: what runs and what is checked; tests/models runs the same tour on
the real coder model ``make run`` serves)."""

from __future__ import annotations

import pytest
from helpers.serve import Server
from helpers.tour import ROOT, check_curl_lines, check_last_block, check_python_block, tour_blocks

pytestmark = [pytest.mark.slow, pytest.mark.extended]   # extended tier: the README's tour against a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tour")
    s = Server(tmp, config=None, repo=ROOT)   # as `make run`, on the bundled model: the repository is the workspace
    yield s
    s.stop()


def test_the_tour_has_its_blocks():
    langs = [lang for lang, _ in tour_blocks()]
    assert langs == ["bash", "python", "bash"], langs


def test_curl_lines(server):
    check_curl_lines(server)


def test_python_block(server):
    check_python_block(server)


def test_last_block(server):
    check_last_block(server)
