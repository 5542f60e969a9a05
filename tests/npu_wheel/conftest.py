"""The pinned torch-npu wheel, fetched once per run into the wheel cache (see wheel_kit.py).

Under CI=true a wheel that cannot be fetched fails the tests; elsewhere they are skipped with the
reason when the package registry cannot be reached.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from meta_kit import MetaFunctions
from schema_kit import atb_schemas, custom_schemas
from wheel_kit import ATB_HEADER, CUSTOM_SCHEMAS, META, Wheel, WheelUnavailable, fetch, pinned_versions


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def wheel() -> Wheel:
    version = pinned_versions()["torch-npu"]
    try:
        return Wheel(fetch(version))
    except WheelUnavailable as e:
        if in_ci() or not e.unreachable:
            pytest.fail(f"the torch-npu {version} wheel is needed for the signature checks: {e}")
        pytest.skip(f"torch-npu {version} wheel not fetched (package registry unreachable: {e}); "
                    "under CI=true this fails")


@pytest.fixture(scope="session")
def signatures(wheel):
    """Every op signature the checks know, by op name: custom ops and ATB ops."""
    return {**atb_schemas(wheel.read_text(ATB_HEADER), ATB_HEADER),
            **custom_schemas(wheel.read_text(CUSTOM_SCHEMAS), CUSTOM_SCHEMAS)}


@pytest.fixture(scope="session")
def meta(wheel) -> MetaFunctions:
    return MetaFunctions(wheel.read_text(META))


@pytest.fixture(scope="session")
def scenarios(meta):
    from standin_kit import run_scenarios
    return run_scenarios(meta)


@pytest.fixture(scope="session")
def valued_scenarios(meta):
    """The same scenarios recorded on the cpu, so the rules that read values can run."""
    from standin_kit import run_scenarios
    return run_scenarios(meta, "cpu")
