"""Scripts the tests start as separate processes (under mpiexec or as torch.distributed ranks); no tests here."""
