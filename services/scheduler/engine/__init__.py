"""The engine core (core.py) and its ports (ports.py): one loop, driven by the scheduler
service over gRPC and by the in-process engine over local objects."""
