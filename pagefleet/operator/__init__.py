"""pagefleet.operator"""
