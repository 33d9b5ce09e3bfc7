"""zerokl.services: the five gRPC services (prefill, decode, trainer, weight-store, scheduler)."""
