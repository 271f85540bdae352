"""An agent's hardware from its Hello to fleet status: converted once, bounded, shown."""

from __future__ import annotations

import json
import logging

import pytest

from router.api.fleet_status import agent_status
from stratus.cli.fleet_views import agents_table, status_json
from stratus.convert.hardware import MAX_FLAGS, MAX_TEXT, describe, from_hello, said_of, to_wire
from stratus.convert.hello import hello_from_wire
from stratus.families.agent_hello import HardwareSaid
from stratus.families.cpu import hardware_precisions
from stratus.wire import fleet_pb2 as fpb

from .test_index import hello, registry

A76 = ["fp", "asimd", "fphp", "asimdhp", "asimddp", "cpuid"]


def _arm_hello(name: str = "pi5") -> fpb.Hello:
    message = hello(name)
    hardware = hardware_precisions(A76, "aarch64", model="Cortex-A76", flags_from="hwcap")
    message.hardware = "aarch64 Cortex-A76"
    message.hardware_info.CopyFrom(to_wire(said_of(hardware)))
    return message


def test_the_wire_form_says_the_machine_the_flags_the_choice_used_and_the_precisions() -> None:
    info = to_wire(said_of(hardware_precisions(A76, "aarch64", model="Cortex-A76", flags_from="hwcap")))
    assert (info.machine, info.cpu_model, info.flags_from) == ("aarch64", "Cortex-A76", "hwcap")
    assert list(info.flags) == ["asimddp", "asimdhp", "fphp"]
    assert list(info.precisions) == ["INT8", "FP16", "FP32"]
    assert describe(info) == "aarch64 Cortex-A76, native int8 fp16 (hwcap: asimddp, asimdhp, fphp)"


def test_a_cpu_without_native_int8_or_fp16_says_fp32_only_and_the_basics_it_found() -> None:
    info = to_wire(said_of(hardware_precisions(["fp", "asimd", "crc32"], "aarch64", flags_from="/proc/cpuinfo")))
    assert describe(info) == "aarch64, fp32 only (/proc/cpuinfo: asimd)"


def test_an_older_agent_is_shown_by_the_machine_in_its_hardware_string() -> None:
    message = hello("old")
    message.hardware = "aarch64 "
    assert from_hello(message) == HardwareSaid(machine="aarch64")


def test_what_a_hello_says_of_its_hardware_is_cut_to_bounds_never_refused() -> None:
    message = _arm_hello()
    message.hardware_info.cpu_model = "A\x1b[31m" + "x" * 500
    message.hardware_info.flags[:] = ["asimddp", "BAD FLAG", "a" * 40, *(f"f{i}" for i in range(100))]
    message.hardware_info.precisions[:] = ["INT8", "FP64", "FP32"]
    info = from_hello(message)
    assert len(info.cpu_model) == MAX_TEXT and info.cpu_model.startswith("A?[31m")
    assert info.flags[0] == "asimddp" and len(info.flags) <= MAX_FLAGS
    assert "BAD FLAG" not in info.flags and "a" * 40 not in info.flags
    assert list(info.precisions) == ["INT8", "FP32"]


def test_the_router_keeps_it_logs_it_and_status_shows_it(caplog: pytest.LogCaptureFixture) -> None:
    reg = registry()
    with caplog.at_level(logging.INFO, logger="stratus.registry"):
        handle = reg.register(hello_from_wire(_arm_hello()), peer="ipv4:127.0.0.1:5000")
    assert handle.hardware.machine == "aarch64"
    assert "agent pi5 joined: tier device, hardware aarch64 Cortex-A76, native int8 fp16" in caplog.text
    status = fpb.FleetStatus(agents=[agent_status(handle, now=reg.now())])
    agent = status_json(status)["agents"][0]
    assert agent["hardware"] == {
        "machine": "aarch64",
        "cpu_model": "Cortex-A76",
        "flags": ["asimddp", "asimdhp", "fphp"],
        "flags_from": "hwcap",
        "precisions": ["INT8", "FP16", "FP32"],
    }
    json.dumps(status_json(status))  # stays JSON
    table = agents_table(status)
    assert "arch" in table[0] and " aarch64 " in table[2]
    assert "pi5: runs on aarch64 Cortex-A76, native int8 fp16 (hwcap: asimddp, asimdhp, fphp)" in table


def test_the_agents_table_cuts_with_an_ellipsis_and_shows_no_data_as_a_dash() -> None:
    from stratus.cli.fleet_views import fit

    assert (
        fit("short", 8) == "short"
        and fit("a-very-long-agent-name", 8) == "a-very-…"
        and len(fit("x" * 30, 8)) == 8
    )
    idle = fpb.FleetStatus(
        agents=[fpb.AgentStatus(id="a-very-long-agent-id-of-a-kiosk-7", tier=fpb.TIER_DEVICE)]
    )
    busy = fpb.FleetStatus(
        agents=[fpb.AgentStatus(id="d-1", tier=fpb.TIER_DEVICE, p50_ms=0.4, p99_ms=1.25, requests_per_s=12.0)]
    )
    (idle_row,) = [line for line in agents_table(idle) if line.startswith("a-very")]
    assert idle_row.startswith("a-very-long-agent-id…") and " -       -       -" in idle_row
    (busy_row,) = [line for line in agents_table(busy) if line.startswith("d-1")]
    assert "0.40" in busy_row and "1.25" in busy_row and "12.0" in busy_row
