"""pagefleet.api"""
