"""Which source wins when launchers nest, and the errors detect_environment passes on."""

from __future__ import annotations

import pytest

from ddpkit.env.base import InconsistentEnvironment
from ddpkit.env.detect import SOURCES, detect_environment
from ddpkit.env.local import LocalVariables
from ddpkit.env.torchrun import TorchrunVariables
from tests.env._recorded import recorded

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1",
    "MASTER_ADDR": "localhost",
    "MASTER_PORT": "29500",
}


def test_sources_order():
    assert [source.name for source in SOURCES] == ["torchrun", "openmpi", "mpich", "slurm", "sagemaker", "local"]
    assert SOURCES[0] is TorchrunVariables and SOURCES[-1] is LocalVariables


@pytest.mark.parametrize(
    ("layers", "source", "rank", "world_size"),
    [
        ([], "local", 0, 1),
        (["slurm_srun_rank1"], "slurm", 1, 2),
        (["openmpi_rank1"], "openmpi", 1, 2),
        # python train.py straight in an sbatch -n 2 script: one process, not task 0 of 2.
        (["slurm_batch_shell"], "local", 0, 1),
        (["slurm_salloc_shell"], "local", 0, 1),
        (["slurm_interactive_step"], "local", 0, 1),
        # torchrun called from the batch script, or from each srun task.
        (["slurm_batch_shell", TORCHRUN], "torchrun", 1, 4),
        (["slurm_srun_rank1", TORCHRUN], "torchrun", 1, 4),
        # torchrun under mpirun, and mpirun inside an sbatch script or srun task.
        (["openmpi_rank0", TORCHRUN], "torchrun", 1, 4),
        (["slurm_batch_shell", "openmpi_rank1"], "openmpi", 1, 2),
        (["slurm_srun_rank0", "openmpi_rank1"], "openmpi", 1, 2),
    ],
)
def test_innermost_launcher_wins(layers, source, rank, world_size):
    environ: dict[str, str] = {}
    for layer in layers:
        environ.update(recorded(layer) if isinstance(layer, str) else layer)
    resolved = detect_environment(environ)
    assert (resolved.source, resolved.rank, resolved.world_size) == (source, rank, world_size)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"WORLD_SIZE": "2"}, "^RANK is unset; start the job with torchrun"),
        ({**TORCHRUN, "RANK": "4"}, "^RANK=4 is not below WORLD_SIZE=4; "),
        (
            {
                **recorded("slurm_srun_rank1"),
                "SLURM_NNODES": "2",
                "SLURM_STEP_NUM_NODES": "2",
                "SLURM_STEP_TASKS_PER_NODE": "<unset>",
                "SLURM_TASKS_PER_NODE": "<unset>",
            },
            "^SLURM_NTASKS=2 on 2 nodes but SLURM_TASKS_PER_NODE and SLURM_NTASKS_PER_NODE are unset; "
            "pass --ntasks-per-node to sbatch or srun$",
        ),
        ({"MASTER_PORT": "99999"}, "^MASTER_PORT=99999 is not a TCP port"),
    ],
)
def test_errors_are_one_line_and_name_the_fix(environ, message):
    environ = {k: v for k, v in environ.items() if v != "<unset>"}
    with pytest.raises(InconsistentEnvironment, match=message) as raised:
        detect_environment(environ)
    assert "\n" not in str(raised.value)
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    "module,old,new",
    [
        ("ddpkit.env", "ClusterEnvironment", "JobEnvironment"),
        ("ddpkit.env.base", "ClusterEnvironment", "JobEnvironment"),
        ("ddpkit.env.slurm", "SlurmEnvironment", "SlurmVariables"),
        ("ddpkit.env.torchrun", "TorchrunEnvironment", "TorchrunVariables"),
        ("ddpkit.env.mpi", "OpenMPIEnvironment", "OpenMPIVariables"),
        ("ddpkit.env.mpi", "MPICHEnvironment", "MPICHVariables"),
        ("ddpkit.env.sagemaker", "SageMakerEnvironment", "SageMakerVariables"),
        ("ddpkit.env.local", "LocalEnvironment", "LocalVariables"),
    ],
)
def test_the_names_before_the_rename_still_work_with_a_deprecation_warning(module, old, new):
    import importlib

    imported = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"{module}.{old} is now {new}; the old name will be removed"):
        assert getattr(imported, old) is getattr(imported, new)
    with pytest.warns(DeprecationWarning):
        exec(f"from {module} import {old}", {})
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        imported.Nothing  # noqa: B018
