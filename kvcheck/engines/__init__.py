"""Engine packages: each registers one `kvcheck.fuzz.engine.Engine` under the `kvcheck.engines` entry points."""
