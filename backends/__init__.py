"""Everything that speaks to engines: adapters, health, pools and the simulated replica."""
