"""Training in processes a traced cell starts (`!python train.py`, `!torchrun`, subprocesses)
and the command line: the start-up hook their interpreters run, the child's recording, and the
kernel's side of the channel they stream to."""
