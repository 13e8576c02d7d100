"""Small hand-built reports for the merge / diff / page tests: the values are chosen here, so the
expected matrix is known without running the code under test."""

from __future__ import annotations

import json

from dsv4_numerics.runner.check import SCHEMA as CHECK_SCHEMA
from dsv4_numerics.oracles.report import Result, report_dict


def R(entry, case, verdict, ulps=None, head=None, stage="decode", msg="", rule="numeric"):
    return Result(entry=entry, stage=stage, case=case, verdict=verdict, rule=rule, worst_ulps=ulps, headroom=head,
                  message=msg)


def meta(arch, vllm="0.33.0", commit="aaaa", device="cuda", sglang=None):
    staged = {"folder": "/s", "vllm_version": vllm, "parts": ["flashmla"], "wheels": []}
    if sglang is not None:  # stage-sglang adds its version and part to the same folder's manifest
        staged.update(sglang_version=sglang, parts=["flashmla", "sglang"])
    return {"arch": arch, "device": device, "hardware": f"{arch} test box", "torch": "2.13.0", "cuda": "13.0",
            "triton": "3.5.0", "staged": [staged], "git_commit": commit}


def pytest_report(path, results, m):
    path.write_text(json.dumps(report_dict(results, m)))
    return str(path)


def check_report(path, results, rows, m):
    d = {"schema": CHECK_SCHEMA, "ok": True, "exit_code": 0, "meta": m, "rows": rows,
         "results": [r.to_dict() for r in results]}
    path.write_text(json.dumps(d))
    return str(path)


def unavailable_row(entry, stage, reason):
    return {"entry": entry, "kind": "kernel", "stage": stage, "cases": 0, "judged": 0, "verdict": "unavailable",
            "worst_ulps": None, "headroom": None, "note": reason}
