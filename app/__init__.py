"""The wideep-serve application: config schema, build_app(), ingress and routing."""
