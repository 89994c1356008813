"""The speed benchmark on pinned worker processes (`python -m scripts.bench.speed.speedup`): its chief, plans,
sizing, budget lines and peers (MultiWorkerMirroredStrategy, Horovod), and runs compared."""
