"""Draft checkpoints for the speculative tests: a tiny target and MTP draft trained on a phrase
corpus (bench/train_mtp.py), once per session (the test workers share it: `made_once`), for tests
whose drafts must be accepted often; and random EAGLE-3 drafts written for the tiny targets."""

from __future__ import annotations

import pytest

from tests.conftest import made_once
from tests.drafts import train


@pytest.fixture(scope="session")
def trained_dir(tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = made_once(
                tmp_path_factory,
                f"mtp_trained_{arch}",
                lambda out: train(arch, out, steps=120, log=lambda *_: None),
            )
        return made[arch]

    return get


@pytest.fixture(params=["deepseek_v3", "glm4_moe"])
def trained(request, trained_dir):
    return trained_dir(request.param)


@pytest.fixture(scope="session")
def eagle3_dir(tiny_dir, tmp_path_factory):
    """(target, draft) directories: a tiny target and a random EAGLE-3 draft written for it."""
    made = {}

    def get(arch: str) -> tuple[str, str]:
        if arch not in made:
            from dserve.models.tiny import make_tiny_eagle3

            target = tiny_dir(arch)
            made[arch] = (
                target,
                make_tiny_eagle3(target, str(tmp_path_factory.mktemp(f"eagle3_{arch}"))),
            )
        return made[arch]

    return get


@pytest.fixture(scope="session")
def trained_eagle3(trained_dir, tmp_path_factory):
    """(target, draft, target info): an EAGLE-3 draft trained (bench/train_eagle3.py) for the trained
    target of `trained_dir`, once per session."""
    made = {}

    def get(arch: str):
        if arch not in made:
            from tests.drafts import train_eagle3

            target, info = trained_dir(arch)
            out, trained = made_once(
                tmp_path_factory,
                f"eagle3_trained_{arch}",
                lambda out: train_eagle3(target, out, steps=150, log=lambda *_: None),
            )
            made[arch] = (target, out, {**info, **trained})
        return made[arch]

    return get
