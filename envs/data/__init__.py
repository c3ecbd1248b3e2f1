"""Small sample data files shipped with the environments and the scripts that generate them."""
