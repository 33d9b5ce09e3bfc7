"""Generated protobuf and gRPC modules for zerokl.v1 (see tools/gen_protos.py)."""
