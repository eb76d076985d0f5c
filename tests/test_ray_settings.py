"""Ray backend settings that are wrong or costly on their own, found without starting Ray: a GPU
index every actor lacks, a Ray address without a port, more ranks than the machine has cores."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentrl.errors import ConfigError
from agentrl.recipe import load_recipe
from agentrl.trainer.ray_settings import check_ray_settings


def ray_recipe(*overrides: str):
    return load_recipe(None, ["trainer.backend=ray", *overrides])


@pytest.mark.parametrize("overrides, key, device", [
    (["trainer.device=cuda:1"], "trainer.device", "cuda:1"),
    (["trainer.device=cuda", "engine.device=cuda:1"], "engine.device", "cuda:1"),
])
def test_a_cuda_index_under_ray_is_a_recipe_error_before_any_actor_starts(overrides, key, device):
    """Each actor sees only the GPU Ray gives it, as cuda:0: 'cuda:1' passed the driver's device
    check and then failed in every rank."""
    import ray

    from agentrl.trainer.launch import RayRoles

    config = ray_recipe(*overrides)
    with pytest.raises(ConfigError) as caught:
        check_ray_settings(config)
    assert str(caught.value) == (f"{key}: '{device}' names a GPU by index, but with trainer.backend 'ray' each actor "
                                 "sees only the GPU Ray gives it; use 'cuda'")
    with pytest.raises(ConfigError):  # the roles check it too, before Ray starts
        RayRoles(config, tokenizer=None)
    assert not ray.is_initialized()


@pytest.mark.parametrize("overrides", [
    ["trainer.device=cuda"], ["trainer.device=cuda:0"],  # every rank's one GPU, as Ray shows it
    ["engine.device=cuda:1"],  # training ranks on CPU get no GPU share: the engines see every GPU
    ["trainer.ray_address=auto"], ["trainer.ray_address=10.0.0.5:6379"], ["trainer.ray_address=ray://head:10001"],
    ["trainer.ray_address=[::1]:6379"],
])
def test_settings_the_actors_can_use_pass(overrides, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one GPU, each rank's
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_ray_settings(ray_recipe(*overrides))
    check_ray_settings(load_recipe(None, ["trainer.device=cuda:1"]))  # the local backend: the index is used


@pytest.mark.parametrize("address", ["localhost", "ray://head", "[::1]", "head:port", ":6379", "head:99999"])
def test_a_ray_address_that_is_no_host_and_port_says_what_is_expected(address):
    """'localhost' was reported as an unreachable cluster, with int()'s ValueError as the cause."""
    from agentrl.trainer.ray_cluster import check_ray_address

    expected = f"trainer.ray_address: expected host:port, ray://host:port or 'auto', got '{address}'"
    with pytest.raises(ConfigError) as caught:
        check_ray_address(address, timeout_s=1)
    assert str(caught.value) == expected
    with pytest.raises(ConfigError) as caught:  # and before any model loads
        check_ray_settings(ray_recipe(f"trainer.ray_address={address}"))
    assert str(caught.value) == expected


def test_train_with_a_ray_address_without_a_port_stops_as_a_recipe_error(tmp_path, tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", "recipes/quickstart.yaml",
                           f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'run'}", "trainer.backend=ray",
                           "trainer.ray_address=localhost"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == ("agentrl: error: trainer.ray_address: expected host:port, "
                                                    "ray://host:port or 'auto', got 'localhost'")
    assert not (tmp_path / "run").exists()  # found before the run wrote anything


def test_more_bundle_cpus_than_cores_warns_and_cuts_each_actors_threads():
    """trainer.world_size=64 on 2 cores started 64 ranks with a thread each per CPU asked for, and
    the local Ray was told the machine had 64 CPUs; it still runs (no refusal), with a warning."""
    from agentrl.trainer.ray_cluster import fair_threads

    threads, warning = fair_threads(64, 1.0, [{"CPU": 1.0}] * 64, cores=2)
    assert threads == 1
    assert warning == ("trainer.world_size 64 at trainer.cpus_per_worker 1 ask for 64 CPUs on a machine with 2 cores: "
                       "the workers share them, 1 torch thread each, and each loads its own model copy")
    # Four ranks of 4 CPUs on 8 cores: 2 threads each; with an engine bundle of its own (split), 1.
    assert fair_threads(4, 4.0, [{"CPU": 4.0}] * 4, cores=8)[0] == 2
    threads, warning = fair_threads(4, 4.0, [{"CPU": 4.0}] * 5, cores=8)
    assert threads == 1 and "trainer.world_size 4 and 1 engine replica bundle (trainer.placement split)" in warning
    # What fits is left alone: the bundle's CPUs as threads, no warning.
    assert fair_threads(2, 1.0, [{"CPU": 1.0}] * 2, cores=2) == (1, None)
    assert fair_threads(2, 4.0, [{"CPU": 4.0}] * 2, cores=16) == (4, None)


def test_a_run_of_its_own_ray_on_too_few_cores_warns_and_gives_its_actors_the_share(monkeypatch, capsys):
    from agentrl.trainer import launch

    class Placed(Exception):
        pass

    def place(roles):
        raise Placed(roles.threads)  # what each actor is started with

    monkeypatch.setattr(launch, "usable_cores", lambda: 2)
    monkeypatch.setattr(launch, "start_local_ray", lambda bundles: None)
    monkeypatch.setattr(launch.RayRoles, "_place", place)
    with pytest.raises(Placed) as placed:  # explicit dtypes: no probe to print its choice
        launch.RayRoles(ray_recipe("trainer.world_size=64", "trainer.cpus_per_worker=2", "model.dtype=float32",
                                   "trainer.dtype=float32"), tokenizer=None)
    assert placed.value.args == (1,)
    assert capsys.readouterr().err == ("agentrl: warning: trainer.world_size 64 at trainer.cpus_per_worker 2 ask for "
                                       "128 CPUs on a machine with 2 cores: the workers share them, 1 torch thread "
                                       "each, and each loads its own model copy\n")


def test_the_cores_counted_are_the_ones_this_process_may_run_on():
    """os.cpu_count() counts the host's cores: under `taskset -c 0` (a container's --cpuset-cpus)
    the ranks' threads were never cut, and the run's own Ray was told it had every core."""
    script = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
              "from agentrl.trainer.ray_cluster import usable_cores; print(usable_cores(), os.cpu_count())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    usable, host = map(int, done.stdout.split())
    assert usable == 1 and host >= 1


def test_ray_actors_get_the_drivers_cpu_dtype_choice_not_a_probe_each():
    """Each actor timed its own probe for `auto`: on a machine whose bf16 and float32 timings are
    close, ranks could choose differently (FSDP shards of two dtypes)."""
    from agentrl.hardware import choose_dtype
    from agentrl.trainer.launch import pinned_cpu_dtypes

    chosen = choose_dtype("auto", "cpu").dtype
    config = load_recipe("recipes/quickstart.yaml", ["trainer.backend=ray"])
    assert (config.model.dtype, config.trainer.dtype) == ("auto", "auto")
    pinned = pinned_cpu_dtypes(config)
    assert (pinned.model.dtype, pinned.trainer.dtype) == (chosen, chosen) and chosen in ("bfloat16", "float32")
    assert pinned.model_dump(exclude={"model": {"dtype"}, "trainer": {"dtype"}}) == config.model_dump(
        exclude={"model": {"dtype"}, "trainer": {"dtype"}})  # nothing else changes
    explicit = load_recipe("recipes/quickstart.yaml", ["trainer.dtype=float32", "model.dtype=float32"])
    assert pinned_cpu_dtypes(explicit) == explicit


@pytest.mark.parametrize("overrides, gpus, message", [
    (["trainer.world_size=2"], 1, "trainer.world_size 2 on cuda needs 2 GPUs, one each; torch {v} sees 1"),
    (["trainer.engine_replicas=2", "trainer.placement=split"], 2,
     "trainer.world_size 1 + 2 engine replicas (trainer.placement 'split') on cuda needs 3 GPUs, one each; torch {v} "
     "sees 2"),
    ([], 0, "trainer.world_size 1 on cuda needs 1 GPU, one each; torch {v} sees none"),
])
def test_more_gpus_than_the_machine_has_are_a_recipe_error_before_ray_starts(overrides, gpus, message, monkeypatch):
    """The run's own Ray was told of as many GPUs as the ranks asked for: a rank got a GPU the
    machine lacks and failed in its CUDA set-up, or, with CUDA_VISIBLE_DEVICES set, ray.init raised
    a bare ValueError (a traceback)."""
    import ray
    import torch

    from agentrl.trainer.launch import RayRoles

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    config = ray_recipe("trainer.device=cuda", *overrides)
    with pytest.raises(ConfigError) as caught:
        check_ray_settings(config)
    assert str(caught.value) == message.format(v=torch.__version__)
    with pytest.raises(ConfigError):
        RayRoles(config, tokenizer=None)
    assert not ray.is_initialized()
    check_ray_settings(ray_recipe("trainer.device=cuda", "trainer.ray_address=auto", *overrides))  # its GPUs: elsewhere
