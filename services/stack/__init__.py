"""Start a stack of the four services and talk to it.

Library code for whoever drives a stack from outside: the ``tokenmill`` command line (``up``,
``generate``, ``profile``) and the serving benchmark. ``launcher`` runs the four service
processes; ``client`` builds requests from plain values and makes the public API's calls;
``dev_ca`` makes the throwaway certificates of ``tokenmill up --tls``.
It prints nothing and stays torch-free: it imports only ``services.common``.
"""
