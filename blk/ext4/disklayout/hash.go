package disklayout

import "math/bits"

// Directory hash seeds used when s_hash_seed is all zero.
var defaultHashSeed = [4]uint32{0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476}

// DirHashHalfMD4 is ext4's half-MD4 directory hash of name (major hash with
// its low bit cleared, as stored in dx_entry), for the given s_hash_seed and
// signedness of char (s_flags).
func DirHashHalfMD4(name []byte, seed [4]uint32, unsigned bool) uint32 {
	buf := defaultHashSeed
	if seed != ([4]uint32{}) {
		buf = seed
	}
	var in [8]uint32
	p := name
	for n := len(p); n > 0; n -= 32 {
		str2hashbuf(p, n, in[:], unsigned)
		halfMD4Transform(&buf, &in)
		if len(p) > 32 {
			p = p[32:]
		} else {
			p = nil
		}
	}
	h := buf[1] &^ 1
	if h == 0x7fffffff<<1 {
		h = (0x7fffffff - 1) << 1
	}
	return h
}

// str2hashbuf packs up to len(buf)*4 bytes of msg into words, padding with
// a length pattern, as the kernel's str2hashbuf_{signed,unsigned}.
func str2hashbuf(msg []byte, n int, buf []uint32, unsigned bool) {
	num := len(buf)
	pad := uint32(n) | uint32(n)<<8
	pad |= pad << 16
	val := pad
	if n > num*4 {
		n = num * 4
	}
	j := 0
	for i := 0; i < n; i++ {
		var c uint32
		if unsigned {
			c = uint32(msg[i])
		} else {
			c = uint32(int32(int8(msg[i])))
		}
		val = c + val<<8
		if i%4 == 3 {
			buf[j] = val
			j++
			val = pad
			num--
		}
	}
	num--
	if num >= 0 {
		buf[j] = val
		j++
	}
	for num--; num >= 0; num-- {
		buf[j] = pad
		j++
	}
}

func halfMD4Transform(buf *[4]uint32, in *[8]uint32) {
	const k2, k3 = 013240474631, 015666365641
	f := func(x, y, z uint32) uint32 { return z ^ (x & (y ^ z)) }
	g := func(x, y, z uint32) uint32 { return (x & y) + ((x ^ y) & z) }
	h := func(x, y, z uint32) uint32 { return x ^ y ^ z }
	a, b, c, d := buf[0], buf[1], buf[2], buf[3]
	r := func(fn func(x, y, z uint32) uint32, a *uint32, b, c, d, x uint32, s int) {
		*a = bits.RotateLeft32(*a+fn(b, c, d)+x, s)
	}
	r(f, &a, b, c, d, in[0], 3)
	r(f, &d, a, b, c, in[1], 7)
	r(f, &c, d, a, b, in[2], 11)
	r(f, &b, c, d, a, in[3], 19)
	r(f, &a, b, c, d, in[4], 3)
	r(f, &d, a, b, c, in[5], 7)
	r(f, &c, d, a, b, in[6], 11)
	r(f, &b, c, d, a, in[7], 19)

	r(g, &a, b, c, d, in[1]+k2, 3)
	r(g, &d, a, b, c, in[3]+k2, 5)
	r(g, &c, d, a, b, in[5]+k2, 9)
	r(g, &b, c, d, a, in[7]+k2, 13)
	r(g, &a, b, c, d, in[0]+k2, 3)
	r(g, &d, a, b, c, in[2]+k2, 5)
	r(g, &c, d, a, b, in[4]+k2, 9)
	r(g, &b, c, d, a, in[6]+k2, 13)

	r(h, &a, b, c, d, in[3]+k3, 3)
	r(h, &d, a, b, c, in[7]+k3, 9)
	r(h, &c, d, a, b, in[2]+k3, 11)
	r(h, &b, c, d, a, in[6]+k3, 15)
	r(h, &a, b, c, d, in[1]+k3, 3)
	r(h, &d, a, b, c, in[5]+k3, 9)
	r(h, &c, d, a, b, in[0]+k3, 11)
	r(h, &b, c, d, a, in[4]+k3, 15)

	buf[0] += a
	buf[1] += b
	buf[2] += c
	buf[3] += d
}
