"""The end-of-job comparison of the programs each rank compiled (no MPI)."""

from __future__ import annotations

from mpijax._src.xla import program_check


def test_layout_is_read_from_the_module_header_without_dimension_orders():
  header = (
    "HloModule jit_step, is_scheduled=true, entry_computation_layout="
    "{(f32[4,3]{1,0}, s32[]{:T(128)})->(f32[3]{0}, f32[])}, "
    "allow_spmd_sharding_propagation_to_parameters={true}"
  )
  assert program_check.layout(header) == "(f32[4,3], s32[]{:T(128)})->(f32[3], f32[])"
  assert program_check.layout("HloModule m") == ""


def test_only_programs_some_rank_lacks_are_listed():
  same = {"a (f32[2])->f32[]", "b (f32[4])->f32[4]"}
  assert program_check.differences({0: set(same), 1: set(same), 2: set(same)}) == []
  lines = program_check.differences(
    {
      0: same | {"c (f32[8])->f32[]"},
      1: same | {"c (f32[8])->f32[]"},
      2: same | {"c (f32[6])->f32[]"},
    }
  )
  assert lines == [
    "c (f32[6])->f32[]: compiled by rank 2, not by ranks 0,1",
    "c (f32[8])->f32[]: compiled by ranks 0,1, not by rank 2",
  ]


def test_the_warning_names_a_few_programs_and_the_fix():
  lines = [f"p{i}: compiled by rank 0, not by rank 1" for i in range(6)]
  text = program_check.message(lines)
  assert "p0: compiled by rank 0, not by rank 1; p1" in text and "p3" in text
  assert "p4" not in text and "and 2 more" in text
  assert "global_shape" in text and "jax.make_array_from_process_local_data" in text


def test_without_a_distributed_runtime_nothing_is_compared_and_nothing_raised(monkeypatch):
  monkeypatch.setattr(program_check, "_programs", {"a (f32[2])->f32[]"})
  monkeypatch.setattr(program_check, "_compared", False)
  monkeypatch.setattr(program_check, "_at_exit", True)  # armed (async dispatch)
  program_check.compare()  # one process, no JAX distributed runtime: returns quietly
  assert program_check._compared is True
  program_check.compare()  # once only


def test_programs_are_compared_at_their_first_collective_unless_dispatch_is_async(monkeypatch):
  from mpijax._src import config

  header = "HloModule jit_f, entry_computation_layout={(f32[2,4]{1,0})->f32[4]{0}}"
  assert program_check.describe("jit_f", header + "\nENTRY ...") == "jit_f (f32[2,4])->f32[4]"
  monkeypatch.delenv("MPIJAX_XLA_DISPATCH", raising=False)
  assert program_check.at_first_collective()  # inline, the default: in the bridge's check
  monkeypatch.setattr(program_check, "_at_exit", False)
  program_check.arm()
  assert program_check._at_exit is False  # nothing left for the job's end
  config.update("xla_dispatch", "async")
  try:
    assert not program_check.at_first_collective()
    monkeypatch.setattr(program_check, "_programs", set())
    program_check.note("jit_f", header, [("all-reduce", "float32", 4, "sum", "jit(f)/psum")])
    assert program_check._programs == {"jit_f (f32[2,4])->f32[4]"}
  finally:
    config.reset("xla_dispatch")
