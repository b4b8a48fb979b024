"""pagefleet.engine.models"""
