"""Helpers shared by the test folders that need the engine itself (``interp_engine`` and its
backends): servers on a loopback port, the command line run in process, child processes, SAE
factories and the comparisons several folders make. Backend-free helpers (tiny models, the HF
oracle, family lists, ``rel_diff``) live in the dev-only ``interp_testkit`` package; no test
module imports another."""
