"""``mpijax-run``: start an mpijax job the way HPC users do.

The launcher (``mpirun``/``mpiexec`` of the MPI that mpi4py uses, or ``srun``
inside a Slurm allocation) is found automatically, the situation decides the
flags (``--allow-run-as-root`` only as root, ``--oversubscribe`` only when the
ranks exceed the slots, never core binding, output tagged by rank), and a
Python program runs under ``python -m mpijax`` so an uncaught exception on
one rank aborts the whole job instead of hanging the others.

Every rank sees the torchrun-style variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` set by the rank itself, see
:mod:`mpijax._src.run.rank`; ``MASTER_ADDR``/``MASTER_PORT`` exported) and
``MPIJAX_RESTART_ATTEMPT``. ``--max-restarts`` relaunches a failed job,
dropping hosts that cannot start processes with ``--min-ranks``.

One concept per module, in the order a launch uses them:

* ``common``: the exit codes, variable names, ``LaunchError``, the parsed
  command line (``Options``) and one attempt's ``Plan``.
* ``mpi_probe``: which MPI library mpi4py loads, and its ``mpirun``.
* ``hosts``: hosts and slots (``--hosts``, ``--hostfile``, this machine's cores).
* ``program``: what every rank runs (``python -m mpijax`` around a Python program).
* ``situation``: the facts about the machine that decide the flags (``survey``).
* ``commands``: the command line of each launcher (Open MPI, Hydra, srun).
* ``process_group``: running the launcher in its own session; signals; no orphan left.
* ``joblog``: the launcher's output: per-rank logs and why an attempt ended.
* ``restarts``: the attempts, their verdicts, restarts and the preflight of hosts.
* ``cli``: the ``mpijax-run`` command line (``mpijax/launch.py`` is its entry point).
"""
