"""Conversions between protobuf messages and the dataclasses the services use inside."""
