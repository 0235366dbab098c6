import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from support.dist_pool import close_pools, pool_of  # noqa: E402
from support.tiny_models import MAKE_TINY_LM, make_tiny_bert, make_tiny_encdec_classifier, write_sharp_lm  # noqa: E402


@pytest.fixture(scope="session")
def dist_pool():
    """dist_pool(world) -> the session's DistPool of that size (support.dist_pool.pool_of)."""
    yield pool_of
    close_pools()


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    return make_tiny_bert(str(tmp_path_factory.mktemp("tiny_bert")))


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory):
    """tiny_lm_dir(family, **overrides) -> a tiny causal LM of that family (tiny_models.MAKE_TINY_LM),
    written once per session for each (family, overrides)."""
    made: dict = {}

    def get(family: str, **overrides) -> str:
        key = (family, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = MAKE_TINY_LM[family](str(tmp_path_factory.mktemp(f"tiny_{family}")), **overrides)
        return made[key]
    return get


@pytest.fixture(scope="session")
def encdec_classifier_dir(tmp_path_factory):
    """encdec_classifier_dir(family) -> a tiny BartForSequenceClassification or
    T5ForSequenceClassification ("bart", "t5"), written once per session."""
    made: dict = {}

    def get(family: str) -> str:
        if family not in made:
            made[family] = make_tiny_encdec_classifier(family, str(tmp_path_factory.mktemp(f"{family}_cls")))
        return made[family]
    return get


@pytest.fixture(scope="session")
def sharp_lm(tmp_path_factory):
    """sharp_lm(family) -> tiny_models.write_sharp_lm's model with its tokenizer, written once per
    session for the generation, script and server tests (writing one trains its tokenizer: ~4 s)."""
    made: dict = {}

    def get(family: str) -> str:
        if family not in made:
            made[family] = write_sharp_lm(family, str(tmp_path_factory.mktemp(f"sharp_{family}")))
        return made[family]
    return get
