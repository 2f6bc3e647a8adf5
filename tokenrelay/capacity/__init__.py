"""``tokenrelay capacity``: the cluster a target needs, from the whole path's costs."""
