"""The body of each ``exactstep`` command, one module per command (X2).

``exactstep NAME ...`` runs ``exactstep.commands.NAME.run(args)`` with the arguments
``cli`` parsed and exits with what it returns; ``cli`` imports the module only then,
so ``--help`` and a usage error stay light. ``launch`` is no command: it checks
``--nproc``/``--nnodes`` and runs a command under torchrun instead (D1).
Design and derivations: docs/design/run.md#commands (X2, X4, D1).
"""
