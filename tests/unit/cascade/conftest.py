"""Coroutine tests here run on a fresh loop each, through ``asyncio.run``: the loop every
Stratus server runs on, and the one the task guard in tests/conftest.py watches."""

from __future__ import annotations

import asyncio
import inspect

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    wanted = inspect.signature(pyfuncitem.obj).parameters
    arguments = {name: pyfuncitem.funcargs[name] for name in wanted}
    asyncio.run(pyfuncitem.obj(**arguments))
    return True
