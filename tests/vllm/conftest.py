"""Fixtures for tests against the real vLLM engine: skipped where vLLM is not installed.

An engine takes tens of seconds to start, so a module shares one (`vllm_engine`), and the
reference run of `vllm.LLM` starts in a subprocess while that engine builds.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import pytest_asyncio

from services.llumlet.engines.vllm.engine import VllmEngine, VllmEngineConfig
from tests.vllm.helpers import small_engine_config_for


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (scripts/install_vllm.sh installs it)")
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def small_engine_config(tiny_model_dir) -> VllmEngineConfig:
    return small_engine_config_for(tiny_model_dir)


@pytest_asyncio.fixture(scope="module")
async def vllm_engine(small_engine_config):
    engine = VllmEngine(small_engine_config)
    # vLLM's import warns about torch deprecations (on the engine thread: the filter is global).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import vllm  # noqa: F401
        except Exception as error:  # a broken install is a skip with its reason, not a crash
            pytest.skip(f"vLLM does not import: {error!r}")
        await engine.start()
    yield engine
    await engine.stop()
