"""Third-party routers launched in front of the same replicas, as benchmark baselines."""
