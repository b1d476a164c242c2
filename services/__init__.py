"""tokenmill services. Importing this package imports nothing else: kernel modules must stay usable without the service stack."""
